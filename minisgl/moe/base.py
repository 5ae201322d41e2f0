"""The interface every MoE backend implements: route the tokens, then run the experts they chose."""

from __future__ import annotations

import torch

from .layer import Experts


class MoEBackend:
    """Two steps of a sparse MoE layer. `capturable`: runs inside CUDA graphs (no host synchronisation,
    shapes fixed by the number of tokens alone)."""

    capturable = False

    def route(
        self, router_logits: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax over the experts, the top_k of each token (weights float32 [T, k], ids int32 [T, k]),
        the weights divided by their sum when `renormalize`."""
        raise NotImplementedError

    def experts(
        self, x: torch.Tensor, experts: Experts, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])) over the chosen experts e this
        rank holds (`experts`: global ids expert_start .. expert_start + num_local - 1, stacked in w13
        [E_local, 2I, H] as gate | up and w2 [E_local, H, I]); the others contribute nothing."""
        raise NotImplementedError
