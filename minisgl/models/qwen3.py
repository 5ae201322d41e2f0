"""Qwen3 and Qwen3-MoE: the Llama decoder with an RMSNorm over each head of q and k before rotary."""

from __future__ import annotations

from typing import ClassVar

from .llama import (
    CPU_DECODE_STEP,
    CUDA_STEP,
    TRITON_LAYER,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


class Qwen3Attention(LlamaAttention):
    qk_norm = True


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention
    # both kernels apply the q/k norm (the C step from its descriptor, the layer kernel from its weights)
    fast_paths: ClassVar[tuple[str, ...]] = (CPU_DECODE_STEP, TRITON_LAYER, CUDA_STEP)


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
