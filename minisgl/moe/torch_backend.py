"""The reference backend: plain torch ops, one expert at a time, on any device (Hugging Face's loop)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import MoEBackend
from .layer import Experts


class TorchMoEBackend(MoEBackend):
    """Readable and exact; its index selects synchronise with the host, so it never runs in a graph."""

    def route(
        self, router_logits: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(router_logits.float(), dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids.to(torch.int32)

    def experts(
        self, x: torch.Tensor, experts: Experts, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        w13, w2 = experts.w13, experts.w2
        local = topk_ids.long() - experts.expert_start
        for e in range(experts.num_local):
            token, slot = torch.nonzero(local == e, as_tuple=True)
            if token.numel() == 0:
                continue  # an expert no token chose costs nothing
            gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[e])
            out.index_add_(0, token, y.float() * topk_weights[token, slot, None])
        return out.to(x.dtype)
