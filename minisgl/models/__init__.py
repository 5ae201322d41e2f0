"""Model registry: `config.json`'s `architectures` picks the model class."""

from __future__ import annotations

from torch import nn

from minisgl.utils import Registry

from .config import ModelConfig
from .llama import LlamaForCausalLM, MixtralForCausalLM
from .qwen3 import Qwen3ForCausalLM

MODELS: Registry[type] = Registry("model architecture")
MODELS.register("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")(LlamaForCausalLM)
# Qwen3-MoE is Qwen3 whose config lists experts (LlamaDecoderLayer.make_mlp builds them)
MODELS.register("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")(Qwen3ForCausalLM)
MODELS.register("MixtralForCausalLM")(MixtralForCausalLM)


def create_model(cfg: ModelConfig) -> nn.Module:
    if cfg.architecture not in MODELS:
        raise ValueError(
            f"unsupported model architecture {cfg.architecture!r}; supported: {', '.join(MODELS.names())}"
        )
    return MODELS.get(cfg.architecture)(cfg)


__all__ = ["MODELS", "ModelConfig", "create_model"]
