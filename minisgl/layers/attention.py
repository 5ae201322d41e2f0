"""The attention layer: hands q/k/v of the current batch to the attention backend in the Context."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.core import get_global_ctx
from minisgl.kernel import Rope, SplitAttention


class AttentionLayer(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5

    def kv_store(self, v: torch.Tensor) -> tuple | None:
        """(k_cache, v_cache, out_loc, v) of this layer when the backend reads the new K/V from the pool
        only, so the rotary kernel may write them there itself (then call forward with stored=True);
        None when the backend stores them."""
        ctx = get_global_ctx()
        if not ctx.attn_backend.kv_from_pool(ctx.batch):
            return None
        return ctx.kv_pool.k(self.layer_id), ctx.kv_pool.v(self.layer_id), ctx.batch.out_loc, v

    def fuses_rope(self) -> bool:
        """Whether the backend applies rotary itself for this batch (then pass q/k unrotated and a Rope)."""
        ctx = get_global_ctx()
        return ctx.attn_backend.fuses_rope(ctx.batch)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor,
        stored: bool = False,
        rope: Rope | None = None,
        defer_merge: bool = False,
    ):
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]; the backend stores k/v into the pool first, unless
        they are there already (stored; k may then be None). rope: q/k are unrotated (see fuses_rope).
        defer_merge: the result goes straight to kernel.linear, so it may be a kernel.SplitAttention."""
        ctx = get_global_ctx()
        out = ctx.attn_backend.forward(
            q, k, v, self.layer_id, ctx.batch, stored=stored, rope=rope, defer_merge=defer_merge
        )
        if isinstance(out, SplitAttention):
            return out
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
