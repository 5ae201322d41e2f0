"""The model's weights loaded as the options say: float parameters from safetensors, a GGUF file read as
stored or dequantized, bf16/fp16 matrices kept as stored, or dummy weights; and their resident bytes."""

from __future__ import annotations

import os

import torch

from minisgl.gguf import StoredWeight, stored
from minisgl.gguf.model_dir import GGUF_LINK
from minisgl.models import ModelConfig
from minisgl.models.stored_weights import load_gguf, load_stored_safetensors
from minisgl.models.weights import init_dummy_weights, iter_safetensors, load_weights
from minisgl.utils import init_logger

from .config import EngineConfig

logger = init_logger(__name__)


def load_model_weights(
    model: torch.nn.Module,
    model_config: ModelConfig,
    config: EngineConfig,
    model_dir: str,
    device: torch.device,
) -> int:
    """Load `model`'s weights from `model_dir` (`config.load_format`, `config.weights_format`); their
    resident bytes. Raises ValueError for a weights format this device or rank count cannot run."""
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
        return resident_weight_bytes(model)
    if config.load_format not in ("auto", "safetensors"):
        raise ValueError(f"unknown load_format {config.load_format!r} (auto, safetensors, dummy)")
    show = config.show_progress and config.tp_info.is_primary()
    gguf_file = os.path.join(model_dir, GGUF_LINK)
    stored_bytes = 0
    if os.path.exists(gguf_file):  # a .gguf file prepared to be read as stored (gguf/model_dir.py)
        # auto: as stored on one CPU rank; on a GPU or with TP, dequantized into the float parameters
        keep = device.type == "cpu" and config.tp_info.size == 1
        keep = keep and config.weights_format != "float32"
        if config.weights_format == "stored" and (not keep or config.tp_info.size > 1):
            raise ValueError("stored GGUF weights run on a CPU with one rank; use --weights-format float32")
        if keep and model_config.moe is not None and config.moe_backend not in ("auto", "torch"):
            raise ValueError(
                "GGUF experts read as stored run on the torch MoE backend: pass --moe-backend torch, "
                "or --weights-format float32"
            )
        stored_bytes = load_gguf(model, gguf_file, keep_stored=keep, show_progress=show)
    elif config.weights_format == "stored":  # bf16/fp16 matrices kept in half precision
        if device.type != "cpu" or config.tp_info.size > 1:
            raise ValueError("--weights-format stored runs on a CPU with one rank")
        if model_config.moe is not None:
            raise ValueError("--weights-format stored does not hold MoE experts; use float32")
        stored_bytes = load_stored_safetensors(model, model_dir, show)
    else:
        load_weights(model, iter_safetensors(model_dir, show), show)
    weight_bytes = resident_weight_bytes(model)
    kept = f", {stored_bytes / 2**20:.1f} MiB of them as stored" if stored_bytes else ""
    logger.info(f"Weights: {weight_bytes / 2**20:.1f} MiB resident{kept}")
    return weight_bytes


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights: float parameters and stored weights, each counted once (tied)."""
    seen, total = set(), 0
    for module in model.modules():
        for w in list(module._parameters.values()) + stored.held_by(module):
            if w is None or id(w) in seen:
                continue
            seen.add(id(w))
            if isinstance(w, StoredWeight):
                total += w.nbytes
            elif isinstance(w, torch.Tensor):
                total += w.numel() * w.element_size()
    return total
