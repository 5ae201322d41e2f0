"""RMSNorm, optionally fused with the residual add."""

from __future__ import annotations

import torch
from torch import nn

from minisgl import kernel


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def load_shard(
        self, name: str, loaded: torch.Tensor, part: int = 0, shard_rank: int | None = None
    ) -> None:
        self.weight.data.copy_(loaded)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is None:
            return kernel.rms_norm(x, self.weight, self.eps)
        return kernel.fused_add_rms_norm(x, residual, self.weight, self.eps)
