"""The attention layer: hands q/k/v of the current batch to the attention backend in the Context."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.core import get_global_ctx


class AttentionLayer(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]; the backend stores k/v into the pool first."""
        ctx = get_global_ctx()
        out = ctx.attn_backend.forward(q, k, v, self.layer_id, ctx.batch)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
