"""The attention layer: rotary, the KV store and attention of the current batch, run by the attention
backend in the Context and cut into kernels as the backend's FusionPlan for that batch says."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from minisgl.core import get_global_ctx
from minisgl.kernel import SplitAttention

if TYPE_CHECKING:
    from .norm import RMSNorm
    from .rotary import RotaryEmbedding


@dataclass(frozen=True)
class FusionPlan:
    """Which neighbours of attention run inside another kernel for one batch: decided by the attention
    backend when it prepares the batch (BaseAttnBackend.fusion_plan) and read by the attention layer. All
    False: rotary, the KV store, attention and the output projection each run as written."""

    # attention takes q/k unrotated with the layer's Rope and rotates them (after Qwen3's q/k norm) and
    # stores the new K/V itself: no rotary or KV-store kernel runs before it
    rope_in_attention: bool = False
    # the rotary kernel writes the new K/V into the pool (attention reads every key from there)
    kv_store_in_rotary: bool = False
    # attention returns its KV splits unmerged (a kernel.SplitAttention) and the output projection's
    # kernel merges them as it reads its input
    merge_in_o_proj: bool = False
    # the decoder layer runs as one launch of the layer kernel (kernel.decode_layer), the backend giving
    # its attention inputs (layer_inputs); a layer the kernel does not serve ignores it and runs as above
    whole_layer: bool = False
    # every layer of the step runs as one launch of the decode-step kernel (kernel.decode_step), the backend
    # giving the pool and the batch's indices (step_inputs); a model the kernel does not serve runs as above
    whole_step: bool = False


UNFUSED = FusionPlan()


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
