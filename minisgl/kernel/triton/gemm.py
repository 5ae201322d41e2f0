"""Triton versions of the elementwise kernels in kernel/reference.py, with the same signatures.

kernel/__init__.py calls these for CUDA tensors. They also run on CPU tensors under TRITON_INTERPRET=1
(set before Triton is imported), which is how the CPU tests check them against the reference.

Every kernel accepts a unit stride on the last dimension and any stride on the others, so the q/k/v views
that come out of the fused QKV projection need no copy.

On Hopper and newer GPUs the kernels launch with programmatic dependent launch (PDL): a kernel may start
while the one before it is still running, and waits for it (`gdc_begin`) before it touches anything that
kernel may write; only reads of weights come before the wait. The next kernel's launch is released right
after the wait, so at most two kernels overlap and every kernel still sees all earlier ones complete.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from minisgl.env import ENV


@functools.cache
def _pdl_on(index: int) -> bool:
    cuda_lang = getattr(tl.extra, "cuda", None)
    return (ENV.pdl and torch.cuda.get_device_capability(index)[0] >= 9
            and hasattr(cuda_lang, "gdc_wait") and hasattr(cuda_lang, "gdc_launch_dependents"))


def pdl(x: torch.Tensor) -> bool:
    """Whether kernels on x's device launch with programmatic dependent launch."""
    return x.is_cuda and _pdl_on(x.device.index if x.device.index is not None else torch.cuda.current_device())


def launch_opts(x: torch.Tensor) -> dict:
    """Extra launch arguments for a kernel whose tensors live on x's device."""
    return {"launch_pdl": True} if pdl(x) else {}


@triton.jit
def gdc_begin(PDL: tl.constexpr):
    """Wait until the previous kernel has finished and its writes are visible, then let the next kernel
    launch. A no-op without PDL; every PDL kernel calls it before its first dependent access."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D [rows, last] tensor with a unit last stride (a view whenever possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _warps(block: int) -> int:
    """More warps for wide rows so each thread keeps a handful of elements in registers."""
    return max(1, min(16, block // 256))


# ---- RMSNorm -------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro,
                     N, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row per program: (optionally residual += x, then) out = w * norm(x) like reference.rms_norm."""
    gdc_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # add in float32, round once to the activation dtype: what torch's residual + x does
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    normed = (xf * tl.rsqrt(var + eps)).to(x.dtype)  # the reference casts back before the weight multiply
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape), as reference.rms_norm."""
    shape, n = x.shape, x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=torch.result_type(weight, x), device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, out, out, x2.stride(0), 0, out.stride(0), 0, n, eps,
                                         HAS_RESIDUAL=False, BLOCK=block, PDL=pdl(x), num_warps=_warps(block),
                                         **launch_opts(x))
    return out.view(shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in place when residual is a unit-stride 2-D view); returns (rms_norm(residual),
    residual). One pass over the row instead of three."""
    shape, n = x.shape, x.shape[-1]
    x2 = _rows(x)
    r2 = _rows(residual)
    out = torch.empty(x2.shape, dtype=torch.result_type(weight, x), device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, r2, x2.stride(0), r2.stride(0), out.stride(0),
                                         r2.stride(0), n, eps, HAS_RESIDUAL=True, BLOCK=block, PDL=pdl(x),
                                         num_warps=_warps(block), **launch_opts(x))
    return out.view(shape), r2.view(shape)


# ---- SiLU and mul --------------------------------------------------------------------------------------
@triton.jit
def _silu_mul(gate, up):
    """silu(gate) * up in up's dtype, rounding where the reference does (silu(gate) before the multiply)."""
    g = gate.to(tl.float32)
    silu = (g * tl.sigmoid(g)).to(up.dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(up.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    gdc_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, _silu_mul(gate, up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    n = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(1024, triton.next_power_of_2(n))
        grid = (x2.shape[0], triton.cdiv(n, block))
        _silu_and_mul_kernel[grid](x2, out, x2.stride(0), out.stride(0), n, BLOCK=block, PDL=pdl(x), num_warps=4,
                                   **launch_opts(x))
    return out.view(*x.shape[:-1], n)


# ---- Rotary embedding (optionally after a per-head RMSNorm) ---------------------------------------------
@triton.jit
def rope_consts(cache_ptr, stride_cache, pos, dims, HALF):
    """cos, sin, partner and sign of every dim at position pos (neox layout: dim d pairs with d + HALF;
    dims past 2 * HALF get cos 1, sin 0 and themselves as partner, so rotation copies them)."""
    rotated = dims < 2 * HALF
    first = dims < HALF
    freq = tl.where(first, dims, dims - HALF)
    cos = tl.load(cache_ptr + pos * stride_cache + freq, mask=rotated, other=1.0)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + freq, mask=rotated, other=0.0)
    partner = tl.where(rotated, tl.where(first, dims + HALF, dims - HALF), dims)
    sign = tl.where(first, -1.0, 1.0)
    return cos, sin, partner, sign


@triton.jit
def rope_rows(base, rows, stride_row, row_mask, w_ptr, eps, cos, sin, partner, sign, dims, D, NORM: tl.constexpr):
    """Rows base[rows] ([R, D] head vectors) rotated: x[d] * cos[d] + sign[d] * x[partner[d]] * sin[d], in
    float32 (the caller rounds). NORM: each row is first RMS-normalised and scaled by w, rounded as
    reference.rms_norm does."""
    mask = row_mask[:, None] & (dims[None, :] < D)
    ptrs = base + rows[:, None] * stride_row
    x = tl.load(ptrs + dims[None, :], mask=mask, other=0.0)
    xp = tl.load(ptrs + partner[None, :], mask=mask, other=0.0)
    if NORM:
        dtype = x.dtype
        xf, xpf = x.to(tl.float32), xp.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]  # xp holds the same values, permuted
        w = tl.load(w_ptr + dims, mask=dims < D, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=dims < D, other=0.0).to(tl.float32)
        x = (w[None, :] * (xf * rstd).to(dtype).to(tl.float32)).to(dtype)
        xp = (wp[None, :] * (xpf * rstd).to(dtype).to(tl.float32)).to(dtype)
    return x.to(tl.float32) * cos[None, :] + sign[None, :] * xp.to(tl.float32) * sin[None, :]


@triton.jit
def _rotate_heads(x_ptr, out_ptr, w_ptr, eps, stride_xt, stride_xh, stride_ot, stride_oh, token, num_heads, cos,
                  sin, partner, sign, D, NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[token, h] = rope_rows(x[token, h]) for every head h at once."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    out = rope_rows(x_ptr + token * stride_xt, heads, stride_xh, heads < num_heads, w_ptr, eps, cos, sin, partner,
                    sign, dims, D, NORM)
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(heads[:, None] < num_heads) & (dims[None, :] < D))


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cache_ptr, q_w_ptr, k_w_ptr, eps, stride_qt,
                   stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cache,
                   v_ptr, v_cache_ptr, loc_ptr, stride_vt, stride_vh, stride_ct, stride_ch, Hq, Hk, D, HALF,
                   NORM: tl.constexpr, STORE: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                   BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """One token per program: rotates the first 2*HALF dims of every q and k head (neox layout: dim d
    pairs with d + HALF) and copies the rest; NORM: RMSNorm each head first (Qwen3's q/k norm).
    STORE: the rotated k goes straight into the KV pool row loc[token] (k_out_ptr is the K cache) and v
    is copied into the V cache there, so no separate KV-store kernel runs."""
    gdc_begin(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    cos, sin, partner, sign = rope_consts(cache_ptr, stride_cache, pos, dims, HALF)
    _rotate_heads(q_ptr, q_out_ptr, q_w_ptr, eps, stride_qt, stride_qh, stride_qot, stride_qoh, token, Hq, cos,
                  sin, partner, sign, D, NORM, BLOCK_HQ, BLOCK_D)
    if STORE:
        slot = tl.load(loc_ptr + token).to(tl.int64)  # int64: slot * row size overflows int32 in large pools
        # the K cache row of this token stands in for k_out[token] (a token stride of 0)
        _rotate_heads(k_ptr, k_out_ptr + slot * stride_ct, k_w_ptr, eps, stride_kt, stride_kh, 0, stride_ch, token,
                      Hk, cos, sin, partner, sign, D, NORM, BLOCK_HK, BLOCK_D)
        heads = tl.arange(0, BLOCK_HK)
        mask = (heads[:, None] < Hk) & (dims[None, :] < D)
        v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
        tl.store(v_cache_ptr + slot * stride_ct + heads[:, None] * stride_ch + dims[None, :],
                 v.to(v_cache_ptr.dtype.element_ty), mask=mask)
    else:
        _rotate_heads(k_ptr, k_out_ptr, k_w_ptr, eps, stride_kt, stride_kh, stride_kot, stride_koh, token, Hk, cos,
                      sin, partner, sign, D, NORM, BLOCK_HK, BLOCK_D)


def _rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
            q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
            kv_store: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "rotary needs a unit stride on the head dim"
    T, Hq, D = q.shape
    Hk = k.shape[1]
    half = cos_sin_cache.shape[-1] // 2
    assert 2 * half <= D and cos_sin_cache.stride(-1) == 1
    norm = q_weight is not None
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if kv_store is not None:
        k_cache, v_cache, out_loc, v = kv_store
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and v.stride(-1) == 1
        k_out, stride_kot, stride_koh = k_cache, 0, k_cache.stride(1)
        v_args = (v, v_cache, out_loc, v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1))
    else:
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        stride_kot, stride_koh = k_out.stride(0), k_out.stride(1)
        v_args = (k, k, positions, 0, 0, 0, 0)  # unused without STORE
    if T:
        _rotary_kernel[(T,)](q, k, q_out, k_out, positions, cos_sin_cache, q_weight if norm else q,
                             k_weight if norm else k, eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                             q_out.stride(0), q_out.stride(1), stride_kot, stride_koh, cos_sin_cache.stride(0),
                             *v_args, Hq, Hk, D, half, NORM=norm, STORE=kv_store is not None,
                             BLOCK_HQ=triton.next_power_of_2(Hq), BLOCK_HK=triton.next_power_of_2(Hk),
                             BLOCK_D=triton.next_power_of_2(D), PDL=pdl(q), num_warps=4, **launch_opts(q))
    return q_out, (None if kv_store is not None else k_out)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 kv_store: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Neox rotary on q [T, Hq, D] and k [T, Hk, D] (new tensors, like the reference); the cache is
    [max_pos, rot_dim] float32 (cos | sin halves) and rot_dim may be smaller than D.
    kv_store = (k_cache, v_cache, out_loc, v): write the rotated k and v into the pool rows out_loc
    instead of returning k (returns (q, None)), as reference.store_kv would."""
    return _rotary(q, k, positions, cos_sin_cache, None, None, 0.0, kv_store)


def qk_norm_rotary(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                   positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                   kv_store: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over each head of q and k (weights [D]), then rotary, in one launch: as
    reference.qk_norm_rotary; kv_store as in apply_rotary."""
    assert q_weight.shape == k_weight.shape == (q.shape[-1],)
    return _rotary(q, k, positions, cos_sin_cache, q_weight, k_weight, eps, kv_store)


# ---- KV store ------------------------------------------------------------------------------------------
@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, loc_ptr, stride_kt, stride_kh, stride_vt,
                     stride_vh, stride_ct, stride_ch, H, D, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     PDL: tl.constexpr):
    """One token per program: its K and V rows (all heads) go to pool row loc[token]."""
    gdc_begin(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + token).to(tl.int64)  # int64: slot * row size overflows int32 in large pools
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < H) & (dims[None, :] < D)
    dst = slot * stride_ct + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, out_loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Write the new tokens' K/V [T, Hkv, D] into the pool rows `out_loc` [T]."""
    T, H, D = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(-1) == 1
    if T:
        _store_kv_kernel[(T,)](k, v, k_cache, v_cache, out_loc, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               k_cache.stride(0), k_cache.stride(1), H, D, BLOCK_H=triton.next_power_of_2(H),
                               BLOCK_D=triton.next_power_of_2(D), PDL=pdl(k), num_warps=4, **launch_opts(k))


# ---- GEMV (decode at batch size 1) ---------------------------------------------------------------------
@triton.jit
def _gemv_input(x_ptr, r_ptr, offs_k, k_mask, ADD: tl.constexpr):
    """A K block of the input row: x, or x + residual rounded once to x's dtype (as torch adds them)."""
    x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
    if ADD:
        r = tl.load(r_ptr + offs_k, mask=k_mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _gemv_block_input(x_ptr, r_ptr, nw_ptr, rstd, K: tl.constexpr, k0, BLOCK_K: tl.constexpr,
                      GATED: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr):
    """The K block at k0 of the row the GEMV multiplies: x (+ residual), normalised, or silu(gate) * up."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    x = _gemv_input(x_ptr, r_ptr, offs_k, k_mask, ADD)
    if NORM:  # rounded where reference.rms_norm rounds: the normalised row, then the weight product
        nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0)
        x = (nw.to(tl.float32) * (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)).to(x.dtype)
    if GATED:
        x = _silu_mul(x, tl.load(x_ptr + K + offs_k, mask=k_mask, other=0.0))
    return x.to(tl.float32)


@triton.jit
def _merged_input(o_ptr, lse_ptr, n_splits, stride_oh, stride_os, stride_lh, offs_k, k_mask, HEAD_D: tl.constexpr,
                  dtype: tl.constexpr):
    """Input elements offs_k (head = k // HEAD_D) of a split-KV attention output that is still in parts:
    sum_s 2^(lse_s - max lse) o_s / sum_s 2^(lse_s - max lse) over the n_splits splits that hold keys,
    rounded to dtype, as the decode merge kernel writes it."""
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
def _gemv_kernel(x_ptr, r_ptr, h_ptr, nw_ptr, eps, w_ptr, b_ptr, y_ptr, N, stride_wn, lse_ptr, seq_len_ptr,
                 stride_oh, stride_os, stride_lh, NUM_SPLITS, K: tl.constexpr, GATED: tl.constexpr,
                 NORM: tl.constexpr, ADD: tl.constexpr, HAS_BIAS: tl.constexpr, MERGE: tl.constexpr,
                 HEAD_D: tl.constexpr, SPLIT_N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    """y[n block] = W[n block] x for one row x. The first K block of W (with the tuned tiles, the whole
    slice: BLOCK_K >= K) is loaded before waiting for the previous kernel, since weights never depend on
    it: under programmatic dependent launch this kernel's weights stream in while the previous one runs.
    GATED: x is [gate | up] (2K wide) and the input is silu(gate) * up, as silu_and_mul.
    NORM: the input is rms_norm(h, nw) with h = x (+ residual if ADD), as reference.(fused_add_)rms_norm;
    every program normalises the row itself; with ADD, program 0 stores h (a new tensor: none reads it).
    MERGE: x is one request's split-KV decode attention output still in parts (x_ptr the partial outputs
    [heads, splits, HEAD_D], lse_ptr their log2-sum-exps; splits as the decode kernel cut seq_len), merged
    here as the merge kernel would, so that kernel does not run."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
    gdc_begin(PDL)
    rstd = 0.0
    if NORM:
        sumsq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            mask = offs < K
            h = _gemv_input(x_ptr, r_ptr, offs, mask, ADD)
            if ADD:  # noqa: SIM102 (a constexpr branch around a run-time one)
                if pid == 0:
                    tl.store(h_ptr + offs, h, mask=mask)
            sumsq += h.to(tl.float32) * h.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(sumsq, axis=0) / K + eps)
    n_splits = 0
    if MERGE:
        seq_len = tl.load(seq_len_ptr)
        n_splits = tl.cdiv(seq_len, tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), SPLIT_N) * SPLIT_N)
        x = _merged_input(x_ptr, lse_ptr, n_splits, stride_oh, stride_os, stride_lh, offs_k, offs_k < K, HEAD_D,
                          w_ptr.dtype.element_ty)
    else:
        x = _gemv_block_input(x_ptr, r_ptr, nw_ptr, rstd, K, 0, BLOCK_K, GATED, NORM, ADD)
    y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    for k0 in tl.static_range(BLOCK_K, K, BLOCK_K):  # only with tiles narrower than K
        offs = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + offs[None, :], mask=n_mask[:, None] & (offs < K)[None, :], other=0.0)
        if MERGE:
            x = _merged_input(x_ptr, lse_ptr, n_splits, stride_oh, stride_os, stride_lh, offs, offs < K, HEAD_D,
                              w_ptr.dtype.element_ty)
        else:
            x = _gemv_block_input(x_ptr, r_ptr, nw_ptr, rstd, K, k0, BLOCK_K, GATED, NORM, ADD)
        y += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def _half_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x is 2-D half-precision activations with unit last stride, W row-major in the same dtype."""
    return (x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and x.stride(-1) == 1 and weight.stride(-1) == 1)


def gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether gemv() serves y = x W^T: one row of half-precision activations against a row-major W.
    Measured on an H200 at Qwen3-0.6B shapes (graphs of back-to-back calls, weights not in L2): 1.1-4x
    faster than cuBLAS at one row; from two rows on cuBLAS was as fast or faster than any tile tried."""
    return _half_rows(x, weight) and x.shape[0] == 1


_GEMV_TILE = 16384  # weight elements a program holds: 32 KB in half precision


def _gemv_tiles(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): a program holds a whole BLOCK_N x K slice of W (up to _GEMV_TILE elements), so
    all its weight loads issue at once, before the wait on the previous kernel."""
    block_k = min(_GEMV_TILE, triton.next_power_of_2(k))
    return max(1, min(16, _GEMV_TILE // block_k)), block_k


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool,
          norm: tuple[torch.Tensor, float, torch.Tensor | None, torch.Tensor] | None,
          tiles: tuple[int, int] | None) -> torch.Tensor:
    n, k = weight.shape
    assert x.shape == (1, 2 * k if gated else k) and x.stride(-1) == 1 and weight.stride(-1) == 1
    block_n, block_k = tiles or _gemv_tiles(n, k)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    norm_weight, eps, residual, h = norm or (weight, 0.0, None, weight)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, h, norm_weight, eps, weight, bias if bias is not None else weight,
        y, n, weight.stride(0), x, x, 0, 0, 0, 1, K=k, GATED=gated, NORM=norm is not None, ADD=residual is not None,
        HAS_BIAS=bias is not None, MERGE=False, HEAD_D=1, SPLIT_N=1, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl(x),
        num_warps=8 if block_n * block_k >= _GEMV_TILE else 4, **launch_opts(x))
    return y


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
    n, k = weight.shape
    block_n, block_k = tiles or _gemv_tiles(n, k)
    y = torch.empty((1, n), dtype=weight.dtype, device=weight.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        mid_o, mid_o, mid_o, weight, 0.0, weight, bias if bias is not None else weight, y, n, weight.stride(0),
        mid_lse, parts.seq_lens, mid_o.stride(1), mid_o.stride(2), mid_lse.stride(1), parts.num_splits, K=k,
        GATED=False, NORM=False, ADD=False, HAS_BIAS=bias is not None, MERGE=True, HEAD_D=mid_o.shape[3],
        SPLIT_N=parts.block_n, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl(weight),
        num_warps=8 if block_n * block_k >= _GEMV_TILE else 4, **launch_opts(weight))
    return y


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
         tiles: tuple[int, int] | None = None) -> torch.Tensor:
    """y = x W^T (+ b) for one row x [1, K] and W [N, K]; gated: x is [1, 2K] = [gate | up] and
    y = silu_and_mul(x) W^T. Bandwidth-bound: W is read once. `tiles` overrides (BLOCK_N, BLOCK_K)."""
    return _gemv(x, weight, bias, gated, None, tiles)


def gemv_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, bias: torch.Tensor | None = None,
                      tiles: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm projection of one row in one launch: h = x + residual (x if residual is None);
    returns (rms_norm(h) W^T (+ b), h), as reference.add_rms_norm_linear."""
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    h = torch.empty_like(x) if residual is not None else x
    return _gemv(x, weight, bias, False, (norm_weight, eps, residual, h), tiles), h


# ---- Weight-stationary GEMM (decode at 2..16 rows) ---------------------------------------------------
@triton.jit
def _gemm_input(x_ptr, r_ptr, stride_xm, stride_rm, offs_m, m_mask, offs_k, k_mask, ADD: tl.constexpr):
    """x[m block, k block], or x + residual rounded once to x's dtype (as torch adds them)."""
    mask = m_mask[:, None] & k_mask[None, :]
    x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    if ADD:
        r = tl.load(r_ptr + offs_m.to(tl.int64)[:, None] * stride_rm + offs_k[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _gemm_rstd(x_ptr, r_ptr, h_ptr, stride_xm, stride_rm, offs_m, m_mask, K, eps, store_h,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ADD: tl.constexpr):
    """1 / rms of rows h = x (+ residual) of the m block, over all of K; with store_h also writes h."""
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        h = _gemm_input(x_ptr, r_ptr, stride_xm, stride_rm, offs_m, m_mask, offs_k, k_mask, ADD)
        if ADD and store_h:
            tl.store(h_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :], h,
                     mask=m_mask[:, None] & k_mask[None, :])
        hf = h.to(tl.float32)
        sumsq += tl.sum(hf * hf, axis=1)
    return tl.rsqrt(sumsq / K + eps)


@triton.jit
def _gemm_rows(acc, w, x_ptr, r_ptr, nw_ptr, rstd, stride_xm, stride_rm, offs_m, m_mask, offs_k, K,
               GATED: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr):
    """acc + W[n block, k block] x[m block, k block]^T, [BLOCK_N, BLOCK_M] in float32, where the input is
    x, or silu(gate) * up (GATED), or rms_norm(x (+ residual)) rounded where reference.rms_norm rounds."""
    k_mask = offs_k < K
    x = _gemm_input(x_ptr, r_ptr, stride_xm, stride_rm, offs_m, m_mask, offs_k, k_mask, ADD)
    if NORM:
        nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        x = (nw[None, :] * (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)).to(x.dtype)
    if GATED:
        up = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + K + offs_k[None, :], mask=m_mask[:, None],
                     other=0.0)
        x = _silu_mul(x, up)
    return tl.dot(w, tl.trans(x.to(w.dtype)), acc)


@triton.jit
def _gemm_store(acc, b_ptr, y_ptr, offs_n, offs_m, n_mask, m_mask, stride_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


@triton.jit
def _gemm_kernel(x_ptr, r_ptr, h_ptr, nw_ptr, eps, w_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm,
                 stride_rm, stride_wn, stride_ym, GATED: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NUM_K: tl.constexpr, PDL: tl.constexpr):
    """y = x W^T for a few rows x [M, K] (GATED: x = [gate | up], [M, 2K], and the input is silu(gate) * up).
    Program (n, s) loads its whole slice of W, rows n block by K slice s (NUM_K = 1, 2 or 4 blocks of
    BLOCK_K), before waiting for the previous kernel: under programmatic dependent launch the weights
    stream in while that kernel runs. Then it multiplies them by every BLOCK_M rows of x, transposed
    (y^T = W x^T: W's rows fill the MMA's long side). With several K slices each program writes its float32
    part to ws[s] and bumps its n block's counter; the last to arrive sums the parts in slice order (the sum
    does not depend on who is last), writes y and resets the counter.
    NORM: the input is rms_norm(h, nw) with h = x (+ residual if ADD), as reference.add_rms_norm_linear;
    every program computes the rows' rms over all of K itself, and with ADD program (0, 0) stores h."""
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
        if NORM:
            store_h = (pid_n + pid_s) == 0
            rstd = _gemm_rstd(x_ptr, r_ptr, h_ptr, stride_xm, stride_rm, offs_m, m_mask, K, eps, store_h, BLOCK_M,
                              BLOCK_K, ADD)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc = _gemm_rows(acc, w0, x_ptr, r_ptr, nw_ptr, rstd, stride_xm, stride_rm, offs_m, m_mask, offs_k, K, GATED,
                         NORM, ADD)
        if NUM_K > 1:
            acc = _gemm_rows(acc, w1, x_ptr, r_ptr, nw_ptr, rstd, stride_xm, stride_rm, offs_m, m_mask,
                             offs_k + BLOCK_K, K, GATED, NORM, ADD)
        if NUM_K > 2:
            acc = _gemm_rows(acc, w2, x_ptr, r_ptr, nw_ptr, rstd, stride_xm, stride_rm, offs_m, m_mask,
                             offs_k + 2 * BLOCK_K, K, GATED, NORM, ADD)
            acc = _gemm_rows(acc, w3, x_ptr, r_ptr, nw_ptr, rstd, stride_xm, stride_rm, offs_m, m_mask,
                             offs_k + 3 * BLOCK_K, K, GATED, NORM, ADD)
        if split == 1:
            _gemm_store(acc, b_ptr, y_ptr, offs_n, offs_m, n_mask, m_mask, stride_ym, HAS_BIAS)
        else:
            part = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
            tl.store(ws_ptr + pid_s * M * N + part, acc, mask=n_mask[:, None] & m_mask[None, :])
    if split > 1:
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
                _gemm_store(acc, b_ptr, y_ptr, offs_n, offs_m, n_mask, m_mask, stride_ym, HAS_BIAS)
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


_GEMM_MAX_ROWS = 16  # from 32 rows on cuBLAS was as fast, and far faster at 128 and more (BENCHMARKS)
_GEMM_MAX_BYTES = 16 << 20  # larger weights take more than one wave of programs: prefetching helps less


def gemm_fits(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """Whether gemm() serves y = x W^T: 2.._GEMM_MAX_ROWS rows of half-precision activations against a
    row-major W of at most _GEMM_MAX_BYTES whose K is a multiple of 64."""
    n, k = weight.shape
    return (_half_rows(x, weight) and 2 <= x.shape[0] <= _GEMM_MAX_ROWS and x.shape[1] == (2 * k if gated else k)
            and k % 64 == 0 and n * k * weight.element_size() <= _GEMM_MAX_BYTES)


def _gemm_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, NUM_K, num_warps): programs of 64 rows of W by a K slice of 512 (2 blocks
    of 256; a smaller power of two where 512 does not divide K), 4 warps. In a sweep on an H200
    (python -m minisgl.benchmark.gemm --sweep) the fastest in sum over Qwen3-0.6B's four projections at 16
    rows, within 2% of the fastest at 4: 64 to 192 programs, each holding 64 KB of weights."""
    k_slice = min(512, k & -k)  # k & -k: the largest power of two dividing K
    block_k = min(256, k_slice)
    return max(16, min(64, triton.next_power_of_2(m))), 64, block_k, k_slice // block_k, 4


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool,
          norm: tuple[torch.Tensor, float, torch.Tensor | None, torch.Tensor] | None,
          config: tuple[int, int, int, int, int] | None) -> torch.Tensor:
    m = x.shape[0]
    n, k = weight.shape
    block_m, block_n, block_k, num_k, warps = config or _gemm_config(m, n, k)
    assert num_k in (1, 2, 4) and k % (block_k * num_k) == 0, "K must be a whole number of K slices"
    split = k // (block_k * num_k)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n), split)
    if split > 1:
        assert grid[0] <= _MAX_N_BLOCKS
        ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counters = _split_counters(x.device)
    else:
        ws = counters = y
    norm_weight, eps, residual, h = norm or (weight, 0.0, None, y)
    r = residual if residual is not None else x
    _gemm_kernel[grid](x, r, h, norm_weight, eps, weight, bias if bias is not None else weight, y, ws, counters, m,
                       n, k, x.stride(0), r.stride(0), weight.stride(0), y.stride(0), GATED=gated,
                       NORM=norm is not None, ADD=residual is not None, HAS_BIAS=bias is not None, BLOCK_M=block_m,
                       BLOCK_N=block_n, BLOCK_K=block_k, NUM_K=num_k, PDL=pdl(x), num_warps=warps,
                       **launch_opts(x))
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
    h = torch.empty_like(x) if residual is not None else x
    return _gemm(x, weight, bias, False, (norm_weight, eps, residual, h), config), h


# ---- Greedy token (argmax over the vocabulary) -----------------------------------------------------------
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
    rows holding NaN are not supported). Two launches: every (row, chunk) in parallel, then one merge per
    row, so a large batch of vocabulary-wide rows reads at full bandwidth."""
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
