"""The structured arguments some ops take (NamedTuples of tensors): the rotary applied inside attention,
a split-KV attention output still in parts, a decoder layer's weights for the one-launch layer kernel,
and a batch's per-row sampling parameters. Shared by the op entry points (kernel/__init__.py) and their
Triton kernels, which import them from here."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class Rope(NamedTuple):
    """Rotary embedding for an attention backend that applies it inside its kernel (the fusion plan's
    rope_in_attention): neox layout, cos|sin table [max_pos, rot_dim] float32; q_weight/k_weight: Qwen3's
    per-head RMSNorm first."""

    positions: torch.Tensor  # [T] position of each new token
    cos_sin_cache: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float


class SplitAttention(NamedTuple):
    """A split-KV decode attention output still in parts, handed to the output projection so that one
    kernel merges the splits and multiplies (the fusion plan's merge_in_o_proj: one request on a GPU);
    linear() merges it first where that kernel does not serve. Splits follow the decode kernel's cut: seq_len over num_splits, rounded up to block_n keys."""

    mid_o: torch.Tensor  # [B, Hq, num_splits, D] float32 normalised partial outputs
    mid_lse: torch.Tensor  # [B, Hq, num_splits] their log2-sum-exps
    seq_lens: torch.Tensor  # [B]
    num_splits: int
    block_n: int
    dtype: torch.dtype  # of the merged output
    merge: Callable[[], torch.Tensor]  # runs the merge kernel: the output as [B, Hq * D]


class LayerWeights(NamedTuple):
    """The tensors of one dense decoder layer that decode_layer reads: the pre-norms, the projections
    (W row-major, [gate | up] stacked) and Qwen3's q/k norms (None for Llama)."""

    in_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    eps: float


class SamplingRows(NamedTuple):
    """A batch's per-row sampling parameters on the device, as `sample` reads them (an unlimited filter
    holds its neutral value: top_k >= vocab, top_p 1, min_p 0)."""

    temperature: torch.Tensor  # [S] float32; 0: greedy
    top_p: torch.Tensor  # [S] float32
    min_p: torch.Tensor  # [S] float32
    top_k: torch.Tensor  # [S] int64
    seed: torch.Tensor  # [S] int64, a seeded row's own seed
    counter: torch.Tensor  # [S] int64: a seeded row's position; >= reference.UNSEEDED: the step seed's stream
    step_seed: torch.Tensor  # [1] int64, drawn from torch's generator every step
    # whether some row sets top-k / top-p (False skips that search's passes, and the reference's sort)
    has_top_k: bool = True
    has_top_p: bool = True
