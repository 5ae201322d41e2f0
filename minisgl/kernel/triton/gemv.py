"""Matrix-vector products for decode at batch size 1: y = W in(x) for one row, where the input is the row
itself or silu(gate) * up of a gated MLP (gemv), rms_norm(x (+ residual)) of a pre-norm block
(gemv_add_rms_norm), or a split-KV decode attention output still in its splits, merged as it is read
(gemv_merged). One kernel per kind of input; they share the weight prefetch, the reduction and the store.

Bandwidth-bound: W is read once. With the default tiles a program holds a whole BLOCK_N x K slice of W and
loads it before waiting for the previous kernel, since weights never depend on it: under programmatic
dependent launch the weights stream in while the previous kernel runs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activation import silu_mul
from .attention import _split_len
from .launch import gdc_begin, half_rows, launch_opts, pdl


# ---- shared by the three kernels -------------------------------------------------------------------------
@triton.jit
def _weight_block(w_rows, n_mask, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K block at k0 of this program's rows of W."""
    offs = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_rows + offs[None, :], mask=n_mask[:, None] & (offs < K)[None, :], other=0.0)


@triton.jit
def _weights(w_ptr, stride_wn, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's output rows (offsets and mask), its rows of W, and their first K block (loaded before
    the wait on the previous kernel; with the default tiles, BLOCK_K >= K, the whole slice)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    return offs_n, n_mask, w_rows, _weight_block(w_rows, n_mask, 0, K, BLOCK_K)


@triton.jit
def _dot(w, x):
    """A block of W times a float32 block of the input, summed over K: [BLOCK_N] in float32."""
    return tl.sum(w.to(tl.float32) * x[None, :], axis=1)


@triton.jit
def _store(y, b_ptr, y_ptr, offs_n, n_mask):
    """y (+ bias where b_ptr is given) in y's dtype."""
    if b_ptr is not None:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


# ---- the row, or silu(gate) * up ------------------------------------------------------------------------
@triton.jit
def _row_block(x_ptr, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr):
    """The K block at k0 of the input in float32: x, or silu(gate) * up of x = [gate | up] (GATED)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
    if GATED:
        x = silu_mul(x, tl.load(x_ptr + K + offs_k, mask=k_mask, other=0.0))
    return x.to(tl.float32)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, stride_wn, K: tl.constexpr, GATED: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """y[n block] = W[n block] x for one row x; GATED: x is [gate | up] (2K wide) and the input is
    silu(gate) * up, as silu_and_mul."""
    offs_n, n_mask, w_rows, w = _weights(w_ptr, stride_wn, N, K, BLOCK_N, BLOCK_K)
    gdc_begin(PDL)
    y = _dot(w, _row_block(x_ptr, 0, K, BLOCK_K, GATED))
    for k0 in tl.static_range(BLOCK_K, K, BLOCK_K):  # only with tiles narrower than K
        y += _dot(_weight_block(w_rows, n_mask, k0, K, BLOCK_K), _row_block(x_ptr, k0, K, BLOCK_K, GATED))
    _store(y, b_ptr, y_ptr, offs_n, n_mask)


# ---- rms_norm(x (+ residual)) -----------------------------------------------------------------------------
@triton.jit
def _sum_block(x_ptr, r_ptr, offs_k, k_mask):
    """A K block of h = x, or of h = x + residual rounded once to x's dtype (as torch adds them)."""
    x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
    if r_ptr is not None:
        r = tl.load(r_ptr + offs_k, mask=k_mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _row_rstd(x_ptr, r_ptr, h_ptr, eps, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / rms of h over all of K (every program computes it itself); with h_ptr, program 0 stores h."""
    sumsq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        mask = offs < K
        h = _sum_block(x_ptr, r_ptr, offs, mask)
        if h_ptr is not None:  # noqa: SIM102 (a constexpr branch around a run-time one)
            if tl.program_id(0) == 0:
                tl.store(h_ptr + offs, h, mask=mask)
        sumsq += h.to(tl.float32) * h.to(tl.float32)
    return tl.rsqrt(tl.sum(sumsq, axis=0) / K + eps)


@triton.jit
def _normed_block(x_ptr, r_ptr, nw_ptr, rstd, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K block at k0 of rms_norm(h, nw) in float32, rounded where reference.rms_norm rounds: the
    normalised row, then the weight product."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    x = _sum_block(x_ptr, r_ptr, offs_k, k_mask)
    nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0)
    x = (nw.to(tl.float32) * (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _gemv_norm_kernel(x_ptr, r_ptr, h_ptr, nw_ptr, eps, w_ptr, b_ptr, y_ptr, N, stride_wn, K: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """y[n block] = W[n block] rms_norm(h, nw) with h = x (+ residual where r_ptr is given), as
    reference.add_rms_norm_linear; with a residual h is a new tensor that program 0 writes to h_ptr."""
    offs_n, n_mask, w_rows, w = _weights(w_ptr, stride_wn, N, K, BLOCK_N, BLOCK_K)
    gdc_begin(PDL)
    rstd = _row_rstd(x_ptr, r_ptr, h_ptr, eps, K, BLOCK_K)
    y = _dot(w, _normed_block(x_ptr, r_ptr, nw_ptr, rstd, 0, K, BLOCK_K))
    for k0 in tl.static_range(BLOCK_K, K, BLOCK_K):  # only with tiles narrower than K
        x = _normed_block(x_ptr, r_ptr, nw_ptr, rstd, k0, K, BLOCK_K)
        y += _dot(_weight_block(w_rows, n_mask, k0, K, BLOCK_K), x)
    _store(y, b_ptr, y_ptr, offs_n, n_mask)


# ---- a split-KV decode attention output, merged as it is read ------------------------------------------
@triton.jit
def _merged_block(o_ptr, lse_ptr, n_splits, stride_oh, stride_os, stride_lh, k0, K: tl.constexpr,
                  HEAD_D: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """Input elements k0.. (head = k // HEAD_D) of a split-KV attention output that is still in parts:
    sum_s 2^(lse_s - max lse) o_s / sum_s 2^(lse_s - max lse) over the n_splits splits that hold keys,
    rounded to dtype, as the decode merge kernel writes it; returned in float32."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    head = offs_k // HEAD_D
    o_row = o_ptr + head * stride_oh + offs_k % HEAD_D
    lse_row = lse_ptr + head * stride_lh
    m = tl.full(offs_k.shape, float("-inf"), dtype=tl.float32)
    for s in range(n_splits):
        m = tl.maximum(m, tl.load(lse_row + s, mask=k_mask, other=0.0))
    acc = tl.zeros(offs_k.shape, dtype=tl.float32)
    total = tl.zeros(offs_k.shape, dtype=tl.float32)
    for s in range(n_splits):
        w = tl.exp2(tl.load(lse_row + s, mask=k_mask, other=0.0) - m)
        acc += w * tl.load(o_row + s * stride_os, mask=k_mask, other=0.0)
        total += w
    return (acc / total).to(dtype).to(tl.float32)


@triton.jit
def _gemv_merge_kernel(o_ptr, lse_ptr, seq_len_ptr, w_ptr, b_ptr, y_ptr, N, stride_wn, stride_oh, stride_os,
                       stride_lh, NUM_SPLITS, K: tl.constexpr, HEAD_D: tl.constexpr, SPLIT_N: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """y[n block] = W[n block] x where x is one request's split-KV decode attention output still in parts
    (o_ptr the partial outputs [heads, splits, HEAD_D], lse_ptr their log2-sum-exps; the splits cut seq_len
    as the decode kernel does), merged here as the merge kernel would, so that kernel does not run."""
    offs_n, n_mask, w_rows, w = _weights(w_ptr, stride_wn, N, K, BLOCK_N, BLOCK_K)
    gdc_begin(PDL)
    seq_len = tl.load(seq_len_ptr)
    n_splits = tl.cdiv(seq_len, _split_len(seq_len, NUM_SPLITS, SPLIT_N))
    dtype = w_ptr.dtype.element_ty
    y = _dot(w, _merged_block(o_ptr, lse_ptr, n_splits, stride_oh, stride_os, stride_lh, 0, K, HEAD_D, BLOCK_K,
                              dtype))
    for k0 in tl.static_range(BLOCK_K, K, BLOCK_K):  # only with tiles narrower than K
        x = _merged_block(o_ptr, lse_ptr, n_splits, stride_oh, stride_os, stride_lh, k0, K, HEAD_D, BLOCK_K, dtype)
        y += _dot(_weight_block(w_rows, n_mask, k0, K, BLOCK_K), x)
    _store(y, b_ptr, y_ptr, offs_n, n_mask)


# ---- launches ----------------------------------------------------------------------------------------------
_GEMV_TILE = 16384  # weight elements a program holds: 32 KB in half precision


def _gemv_tiles(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): a program holds a whole BLOCK_N x K slice of W (up to _GEMV_TILE elements), so
    all its weight loads issue at once, before the wait on the previous kernel."""
    block_k = min(_GEMV_TILE, triton.next_power_of_2(k))
    return max(1, min(16, _GEMV_TILE // block_k)), block_k


def _tiling(weight: torch.Tensor, tiles: tuple[int, int] | None) -> tuple[tuple[int], dict]:
    """The grid and the tile arguments of a GEMV over W [N, K]; `tiles` overrides (BLOCK_N, BLOCK_K)."""
    n, k = weight.shape
    block_n, block_k = tiles or _gemv_tiles(n, k)
    warps = 8 if block_n * block_k >= _GEMV_TILE else 4
    return (triton.cdiv(n, block_n),), {"K": k, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps}


def gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether gemv() serves y = x W^T: one row of half-precision activations against a row-major W (from
    two rows on, kernel.linear takes the GEMM or cuBLAS: see docs/BENCHMARKS.md)."""
    return half_rows(x, weight) and x.shape[0] == 1


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
         tiles: tuple[int, int] | None = None) -> torch.Tensor:
    """y = x W^T (+ b) for one row x [1, K] and W [N, K]; gated: x is [1, 2K] = [gate | up] and
    y = silu_and_mul(x) W^T. `tiles` overrides (BLOCK_N, BLOCK_K)."""
    n, k = weight.shape
    assert x.shape == (1, 2 * k if gated else k) and x.stride(-1) == 1 and weight.stride(-1) == 1
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    grid, tiling = _tiling(weight, tiles)
    _gemv_kernel[grid](x, weight, bias, y, n, weight.stride(0), GATED=gated, PDL=pdl(x), **tiling, **launch_opts(x))
    return y


def gemv_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, bias: torch.Tensor | None = None,
                      tiles: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm projection of one row in one launch: h = x + residual (x if residual is None);
    returns (rms_norm(h) W^T (+ b), h), as reference.add_rms_norm_linear."""
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    n, k = weight.shape
    assert x.shape == (1, k) and weight.stride(-1) == 1
    h = torch.empty_like(x) if residual is not None else None  # None: h is x itself, nothing to store
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    grid, tiling = _tiling(weight, tiles)
    _gemv_norm_kernel[grid](x, residual, h, norm_weight, eps, weight, bias, y, n, weight.stride(0), PDL=pdl(x),
                            **tiling, **launch_opts(x))
    return y, (x if h is None else h)


def gemv_merge_fits(parts, weight: torch.Tensor) -> bool:
    """Whether gemv_merged() serves linear(parts.merge(), W): one request, W in the parts' dtype."""
    mid_o = parts.mid_o
    return (mid_o.shape[0] == 1 and parts.dtype in (torch.bfloat16, torch.float16) and weight.dtype == parts.dtype
            and weight.shape[1] == mid_o.shape[1] * mid_o.shape[3] and weight.stride(-1) == 1
            and mid_o.stride(-1) == 1)


def gemv_merged(parts, weight: torch.Tensor, bias: torch.Tensor | None = None,
                tiles: tuple[int, int] | None = None) -> torch.Tensor:
    """linear(parts.merge(), W, b) for a one-request split-KV decode output (kernel.SplitAttention) in one
    launch: the GEMV merges the splits as it reads its input."""
    mid_o, mid_lse = parts.mid_o, parts.mid_lse
    y = torch.empty((1, weight.shape[0]), dtype=weight.dtype, device=weight.device)
    grid, tiling = _tiling(weight, tiles)
    _gemv_merge_kernel[grid](mid_o, mid_lse, parts.seq_lens, weight, bias, y, weight.shape[0], weight.stride(0),
                             mid_o.stride(1), mid_o.stride(2), mid_lse.stride(1), parts.num_splits,
                             HEAD_D=mid_o.shape[3], SPLIT_N=parts.block_n, PDL=pdl(weight), **tiling,
                             **launch_opts(weight))
    return y
