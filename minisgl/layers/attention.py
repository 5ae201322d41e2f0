"""The attention layer: rotary, the KV store and attention of the current batch, run by the attention
backend in the Context and cut into kernels as the backend's FusionPlan for that batch says
(attention/base.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from minisgl.kernel import SplitAttention

from .context import get_global_ctx

if TYPE_CHECKING:
    from .norm import RMSNorm
    from .rotary import RotaryEmbedding


class AttentionLayer(nn.Module):
    """Attention of one layer over the paged KV pool, the new tokens' K/V stored first."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: RotaryEmbedding,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> torch.Tensor | SplitAttention:
        """q [T, Hq, D], k/v [T, Hkv, D] as the QKV projection made them -> [T, Hq * D]: q/k normalised
        per head (q_norm/k_norm, Qwen3) and rotated, k/v stored into the pool, attention over the pool.
        Under the plan's merge_in_o_proj the result is a kernel.SplitAttention for the output projection."""
        ctx = get_global_ctx()
        backend, batch = ctx.attn_backend, ctx.batch
        plan = backend.fusion_plan(batch)
        if plan.rope_in_attention:
            rope = rotary.spec(batch.positions, q_norm, k_norm)
            out = backend.forward(q, k, v, self.layer_id, batch, rope=rope)
        else:
            kv_store = None  # (k_cache, v_cache, out_loc, v): where the rotary kernel writes the new K/V
            if plan.kv_store_in_rotary:
                kv_store = ctx.kv_pool.k(self.layer_id), ctx.kv_pool.v(self.layer_id), batch.out_loc, v
            q, k = rotary(batch.positions, q, k, q_norm, k_norm, kv_store=kv_store)  # k None: stored
            out = backend.forward(q, k, v, self.layer_id, batch)
        if plan.merge_in_o_proj:
            return out
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
