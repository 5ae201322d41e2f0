"""A greedy token per row: argmax over the vocabulary in two launches (every chunk of every row in
parallel, then one merge per row), so a large batch of vocabulary-wide rows reads at full bandwidth."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import gdc_begin, launch_opts, pdl


@triton.jit
def _argmax_part_kernel(x_ptr, max_ptr, idx_ptr, V, stride_x, CHUNKS, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (row, c): the largest value of chunk c of the row and its first index."""
    gdc_begin(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    best, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(max_ptr + row * CHUNKS + chunk, best)
    tl.store(idx_ptr + row * CHUNKS + chunk, chunk * BLOCK + at)


@triton.jit
def _argmax_merge_kernel(max_ptr, idx_ptr, out_ptr, CHUNKS, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    """The first chunk holding the row's largest value gives the first index of it."""
    gdc_begin(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < CHUNKS
    best = tl.load(max_ptr + row * CHUNKS + offs, mask=mask, other=float("-inf"))
    _, at = tl.max(best, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * CHUNKS + at))


_ARGMAX_BLOCK = 8192  # vocabulary entries a program reads: 16 KB in half precision


def argmax(x: torch.Tensor, block: int = _ARGMAX_BLOCK) -> torch.Tensor:
    """x.argmax(dim=-1) as int32 for a 2-D x with a unit last stride (the first index on ties, as torch;
    rows holding NaN are not supported)."""
    rows, v = x.shape
    chunks = triton.cdiv(v, block)
    maxes = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    idx = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int32, device=x.device)
    if rows:
        _argmax_part_kernel[(rows, chunks)](x, maxes, idx, v, x.stride(0), chunks, BLOCK=block, PDL=pdl(x),
                                            num_warps=8, **launch_opts(x))
        _argmax_merge_kernel[(rows,)](maxes, idx, out, chunks, BLOCK_C=triton.next_power_of_2(chunks), PDL=pdl(x),
                                      num_warps=1, **launch_opts(x))
    return out
