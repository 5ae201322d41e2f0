"""The reference backend: kernel/reference.py's torch ops, one expert at a time, on any device."""

from __future__ import annotations

import torch

from minisgl import kernel
from minisgl.kernel import cpu
from minisgl.kernel import reference as ref

from .base import MoEBackend
from .layer import Experts


class TorchMoEBackend(MoEBackend):
    """Hugging Face's loop over the experts: exact and readable, but it asks the host which experts were
    chosen, so it never runs inside a CUDA graph."""

    def route(
        self, router_logits: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ref.moe_route(router_logits, top_k, renormalize)

    def experts(
        self, x: torch.Tensor, experts: Experts, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if experts.stored is not None:  # GGUF experts as stored
            w13, w2 = experts.stored
            if experts.stored_desc is not None and x.dtype == torch.float32:
                # every chosen expert of every token in one C call
                int8 = w13[0].dot == "int8"
                return cpu.moe_stored(x, topk_ids, topk_weights, experts.stored_desc, experts.shard, int8)
            return ref.fused_moe(x, w13, w2, topk_weights, topk_ids, linear=kernel.linear)
        return ref.fused_moe(x, experts.w13, experts.w2, topk_weights, topk_ids, experts.expert_start)
