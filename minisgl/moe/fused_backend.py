"""The Triton backend (kernel/triton/moe.py): routing and the grouped expert GEMMs on the device, with no
host synchronisation, so decode and prefill CUDA graphs capture them."""

from __future__ import annotations

import torch

from .base import MoEBackend
from .layer import Experts


class FusedMoEBackend(MoEBackend):
    """Top-k routing, tokens sorted by expert on the device, one grouped GEMM for gate|up with SiLU-and-mul
    and one for down with the routing weights applied; runs on CPU tensors under TRITON_INTERPRET=1."""

    capturable = True

    def __init__(self) -> None:
        from minisgl.kernel.triton import moe  # fails here, at start-up, when Triton is missing

        self._ops = moe

    def route(
        self, router_logits: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._ops.moe_route(router_logits, top_k, renormalize)

    def experts(
        self, x: torch.Tensor, experts: Experts, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return self._ops.fused_moe(x, experts.w13, experts.w2, topk_weights, topk_ids, experts.expert_start)
