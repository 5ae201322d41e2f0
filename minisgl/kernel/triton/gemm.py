"""A weight-stationary GEMM for decode at 2..16 rows: y = x W^T, where the input is x, silu(gate) * up of a
gated MLP (gemm(gated=True)), or rms_norm(x (+ residual)) of a pre-norm block (gemm_add_rms_norm).

Each program loads its whole slice of W before waiting for the previous kernel (under programmatic
dependent launch the weights stream in while that kernel runs), then multiplies it by every block of
rows, transposed (y^T = W x^T: W's rows fill the MMA's long side). K may be split over several programs,
whose float32 parts the last one to finish sums in a fixed order."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activation import silu_mul
from .launch import gdc_begin, half_rows, launch_opts, pdl


@triton.jit
def _gemm_input(x_ptr, r_ptr, stride_xm, stride_rm, offs_m, m_mask, offs_k, k_mask):
    """x[m block, k block], or (with r_ptr) x + residual rounded once to x's dtype (as torch adds them)."""
    mask = m_mask[:, None] & k_mask[None, :]
    x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    if r_ptr is not None:
        r = tl.load(r_ptr + offs_m.to(tl.int64)[:, None] * stride_rm + offs_k[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _gemm_rstd(x_ptr, r_ptr, h_ptr, stride_xm, stride_rm, offs_m, m_mask, K, eps, store_h,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / rms of rows h = x (+ residual) of the m block, over all of K; with h_ptr and store_h also
    writes h."""
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        h = _gemm_input(x_ptr, r_ptr, stride_xm, stride_rm, offs_m, m_mask, offs_k, k_mask)
        if h_ptr is not None:  # noqa: SIM102 (a constexpr branch around a run-time one)
            if store_h:
                tl.store(h_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :], h,
                         mask=m_mask[:, None] & k_mask[None, :])
        hf = h.to(tl.float32)
        sumsq += tl.sum(hf * hf, axis=1)
    return tl.rsqrt(sumsq / K + eps)


@triton.jit
def _gemm_rows(acc, w, x_ptr, r_ptr, nw_ptr, rstd, stride_xm, stride_rm, offs_m, m_mask, offs_k, K,
               GATED: tl.constexpr):
    """acc + W[n block, k block] x[m block, k block]^T, [BLOCK_N, BLOCK_M] in float32, where the input is
    x, or silu(gate) * up (GATED), or (with nw_ptr) rms_norm(x (+ residual)) rounded where
    reference.rms_norm rounds."""
    k_mask = offs_k < K
    x = _gemm_input(x_ptr, r_ptr, stride_xm, stride_rm, offs_m, m_mask, offs_k, k_mask)
    if nw_ptr is not None:
        nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        x = (nw[None, :] * (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)).to(x.dtype)
    if GATED:
        up = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + K + offs_k[None, :], mask=m_mask[:, None],
                     other=0.0)
        x = silu_mul(x, up)
    return tl.dot(w, tl.trans(x.to(w.dtype)), acc)


@triton.jit
def _gemm_store(acc, b_ptr, y_ptr, offs_n, offs_m, n_mask, m_mask, stride_ym):
    """y^T's block acc (+ bias where b_ptr is given) in y's dtype."""
    if b_ptr is not None:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


@triton.jit
def _gemm_kernel(x_ptr, r_ptr, h_ptr, nw_ptr, eps, w_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm,
                 stride_rm, stride_wn, stride_ym, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, NUM_K: tl.constexpr, PDL: tl.constexpr):
    """y = x W^T for a few rows x [M, K] (GATED: x = [gate | up], [M, 2K], and the input is silu(gate) * up).
    Program (n, s) loads its whole slice of W, rows n block by K slice s (NUM_K = 1, 2 or 4 blocks of
    BLOCK_K), before waiting for the previous kernel: under programmatic dependent launch the weights
    stream in while that kernel runs. Then it multiplies them by every BLOCK_M rows of x, transposed
    (y^T = W x^T: W's rows fill the MMA's long side). With several K slices (ws_ptr given) each program
    writes its float32 part to ws[s] and bumps its n block's counter; the last to arrive sums the parts in
    slice order (the sum does not depend on who is last), writes y and resets the counter.
    With nw_ptr the input is rms_norm(h, nw) with h = x (+ residual where r_ptr is given), as
    reference.add_rms_norm_linear; every program computes the rows' rms over all of K itself, and with a
    residual program (0, 0) stores h to h_ptr."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    split = tl.num_programs(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_s * (BLOCK_K * NUM_K) + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    w0 = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
    w1 = w0
    w2 = w0
    w3 = w0
    if NUM_K > 1:
        w1 = tl.load(w_ptrs + BLOCK_K, mask=n_mask[:, None], other=0.0)
    if NUM_K > 2:
        w2 = tl.load(w_ptrs + 2 * BLOCK_K, mask=n_mask[:, None], other=0.0)
        w3 = tl.load(w_ptrs + 3 * BLOCK_K, mask=n_mask[:, None], other=0.0)
    gdc_begin(PDL)
    for m0 in tl.range(0, M, BLOCK_M, num_stages=1):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        if nw_ptr is not None:
            store_h = (pid_n + pid_s) == 0
            rstd = _gemm_rstd(x_ptr, r_ptr, h_ptr, stride_xm, stride_rm, offs_m, m_mask, K, eps, store_h, BLOCK_M,
                              BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc = _gemm_rows(acc, w0, x_ptr, r_ptr, nw_ptr, rstd, stride_xm, stride_rm, offs_m, m_mask, offs_k, K, GATED)
        if NUM_K > 1:
            acc = _gemm_rows(acc, w1, x_ptr, r_ptr, nw_ptr, rstd, stride_xm, stride_rm, offs_m, m_mask,
                             offs_k + BLOCK_K, K, GATED)
        if NUM_K > 2:
            acc = _gemm_rows(acc, w2, x_ptr, r_ptr, nw_ptr, rstd, stride_xm, stride_rm, offs_m, m_mask,
                             offs_k + 2 * BLOCK_K, K, GATED)
            acc = _gemm_rows(acc, w3, x_ptr, r_ptr, nw_ptr, rstd, stride_xm, stride_rm, offs_m, m_mask,
                             offs_k + 3 * BLOCK_K, K, GATED)
        if ws_ptr is None:  # one K slice: y directly
            _gemm_store(acc, b_ptr, y_ptr, offs_n, offs_m, n_mask, m_mask, stride_ym)
        else:
            part = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
            tl.store(ws_ptr + pid_s * M * N + part, acc, mask=n_mask[:, None] & m_mask[None, :])
    if ws_ptr is not None:
        tl.debug_barrier()  # every thread's part is stored before the release below
        if tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel") == split - 1:
            for m0 in tl.range(0, M, BLOCK_M, num_stages=1):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                m_mask = offs_m < M
                part = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
                y_mask = n_mask[:, None] & m_mask[None, :]
                acc = tl.load(ws_ptr + part, mask=y_mask, other=0.0, cache_modifier=".cg")
                for s in range(1, split):
                    acc += tl.load(ws_ptr + s * M * N + part, mask=y_mask, other=0.0, cache_modifier=".cg")
                _gemm_store(acc, b_ptr, y_ptr, offs_n, offs_m, n_mask, m_mask, stride_ym)
            tl.store(cnt_ptr + pid_n, 0)


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_MAX_N_BLOCKS = 1 << 16


def _split_counters(device: torch.device) -> torch.Tensor:
    """Zeroed arrival counters for K-split GEMMs (one per n block), one buffer per device, created on first
    use (graph capture warms up first, so never inside a capture). Every launch leaves its counters at
    zero, and launches on one stream never overlap (under PDL each waits for the one before), so they share
    the buffer."""
    counters = _COUNTERS.get(device)
    if counters is None:
        counters = _COUNTERS[device] = torch.zeros(_MAX_N_BLOCKS, dtype=torch.int32, device=device)
    return counters


_GEMM_MAX_ROWS = 16  # more rows go to cuBLAS (docs/BENCHMARKS.md: the GEMM against cuBLAS by row count)
_GEMM_MAX_BYTES = 16 << 20  # larger weights take more than one wave of programs: prefetching helps less


def gemm_fits(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """Whether gemm() serves y = x W^T: 2.._GEMM_MAX_ROWS rows of half-precision activations against a
    row-major W of at most _GEMM_MAX_BYTES whose K is a multiple of 64."""
    n, k = weight.shape
    return (half_rows(x, weight) and 2 <= x.shape[0] <= _GEMM_MAX_ROWS and x.shape[1] == (2 * k if gated else k)
            and k % 64 == 0 and n * k * weight.element_size() <= _GEMM_MAX_BYTES)


def _gemm_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, NUM_K, num_warps): programs of 64 rows of W by a K slice of 512 (2 blocks
    of 256; a smaller power of two where 512 does not divide K), 4 warps: 64 to 192 programs at Qwen3-0.6B's
    projections, each holding 64 KB of weights. Chosen by `python -m minisgl.benchmark.gemm --sweep`
    (docs/BENCHMARKS.md)."""
    k_slice = min(512, k & -k)  # k & -k: the largest power of two dividing K
    block_k = min(256, k_slice)
    return max(16, min(64, triton.next_power_of_2(m))), 64, block_k, k_slice // block_k, 4


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool,
          norm: tuple[torch.Tensor, float, torch.Tensor | None, torch.Tensor | None] | None,
          config: tuple[int, int, int, int, int] | None) -> torch.Tensor:
    m = x.shape[0]
    n, k = weight.shape
    block_m, block_n, block_k, num_k, warps = config or _gemm_config(m, n, k)
    assert num_k in (1, 2, 4) and k % (block_k * num_k) == 0, "K must be a whole number of K slices"
    split = k // (block_k * num_k)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n), split)
    ws = counters = None  # one K slice: no parts to sum
    if split > 1:
        assert grid[0] <= _MAX_N_BLOCKS
        ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counters = _split_counters(x.device)
    norm_weight, eps, residual, h = norm or (None, 0.0, None, None)
    stride_rm = residual.stride(0) if residual is not None else None
    _gemm_kernel[grid](x, residual, h, norm_weight, eps, weight, bias, y, ws, counters, m, n, k, x.stride(0),
                       stride_rm, weight.stride(0), y.stride(0), GATED=gated, BLOCK_M=block_m, BLOCK_N=block_n,
                       BLOCK_K=block_k, NUM_K=num_k, PDL=pdl(x), num_warps=warps, **launch_opts(x))
    return y


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
         config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """y = x W^T (+ b) for a few rows x [M, K] and W [N, K]; gated: x is [M, 2K] = [gate | up] and
    y = silu_and_mul(x) W^T. `config` overrides (BLOCK_M, BLOCK_N, BLOCK_K, NUM_K, num_warps)."""
    return _gemm(x, weight, bias, gated, None, config)


def gemm_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, bias: torch.Tensor | None = None,
                      config: tuple[int, int, int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm projection of a few rows in one launch: h = x + residual (x if residual is None);
    returns (rms_norm(h) W^T (+ b), h), as reference.add_rms_norm_linear."""
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    h = torch.empty_like(x) if residual is not None else None  # None: h is x itself, nothing to store
    return _gemm(x, weight, bias, False, (norm_weight, eps, residual, h), config), (x if h is None else h)


