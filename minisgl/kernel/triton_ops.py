"""Triton versions of the elementwise kernels in kernel/reference.py, with the same signatures.

kernel/__init__.py calls these for CUDA tensors. They also run on CPU tensors under TRITON_INTERPRET=1
(set before Triton is imported), which is how the CPU tests check them against the reference.

Every kernel accepts a unit stride on the last dimension and any stride on the others, so the q/k/v views
that come out of the fused QKV projection need no copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
                     N, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One row per program: (optionally residual += x, then) out = w * norm(x) like reference.rms_norm."""
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
                                         HAS_RESIDUAL=False, BLOCK=block, num_warps=_warps(block))
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
                                         r2.stride(0), n, eps, HAS_RESIDUAL=True, BLOCK=block,
                                         num_warps=_warps(block))
    return out.view(shape), r2.view(shape)


# ---- SiLU and mul --------------------------------------------------------------------------------------
@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0)
    silu = (gate * tl.sigmoid(gate)).to(up.dtype)  # the reference rounds silu(gate) before the multiply
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    n = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(1024, triton.next_power_of_2(n))
        grid = (x2.shape[0], triton.cdiv(n, block))
        _silu_and_mul_kernel[grid](x2, out, x2.stride(0), out.stride(0), n, BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], n)


# ---- Rotary embedding ----------------------------------------------------------------------------------
@triton.jit
def _rotate_heads(x_ptr, out_ptr, stride_xt, stride_xh, stride_ot, stride_oh, token, num_heads, cos, sin,
                  partner, sign, D, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[token, h, d] = x[d] * cos[d] + sign[d] * x[partner[d]] * sin[d] for every head h at once."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < D)
    base = x_ptr + token * stride_xt + heads[:, None] * stride_xh
    x = tl.load(base + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    out = x * cos[None, :] + sign[None, :] * xp * sin[None, :]
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cache_ptr, stride_qt, stride_qh, stride_kt,
                   stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cache, Hq, Hk, D, HALF,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token per program: rotates the first 2*HALF dims of every q and k head (neox layout: dim d
    pairs with d + HALF) and copies the rest."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    rotated = dims < 2 * HALF
    first = dims < HALF
    freq = tl.where(first, dims, dims - HALF)
    cos = tl.load(cache_ptr + pos * stride_cache + freq, mask=rotated, other=1.0)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + freq, mask=rotated, other=0.0)
    # dims past the rotary part: cos 1, sin 0, so they are copied unchanged
    partner = tl.where(rotated, tl.where(first, dims + HALF, dims - HALF), dims)
    sign = tl.where(first, -1.0, 1.0)
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, token, Hq, cos, sin, partner,
                  sign, D, BLOCK_HQ, BLOCK_D)
    _rotate_heads(k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, token, Hk, cos, sin, partner,
                  sign, D, BLOCK_HK, BLOCK_D)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary on q [T, Hq, D] and k [T, Hk, D] (new tensors, like the reference); the cache is
    [max_pos, rot_dim] float32 (cos | sin halves) and rot_dim may be smaller than D."""
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "rotary needs a unit stride on the head dim"
    T, Hq, D = q.shape
    Hk = k.shape[1]
    half = cos_sin_cache.shape[-1] // 2
    assert 2 * half <= D and cos_sin_cache.stride(-1) == 1
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if T:
        _rotary_kernel[(T,)](q, k, q_out, k_out, positions, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0),
                             k.stride(1), q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
                             cos_sin_cache.stride(0), Hq, Hk, D, half, BLOCK_HQ=triton.next_power_of_2(Hq),
                             BLOCK_HK=triton.next_power_of_2(Hk), BLOCK_D=triton.next_power_of_2(D), num_warps=4)
    return q_out, k_out


# ---- KV store ------------------------------------------------------------------------------------------
@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, loc_ptr, stride_kt, stride_kh, stride_vt,
                     stride_vh, stride_ct, stride_ch, H, D, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token per program: its K and V rows (all heads) go to pool row loc[token]."""
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
                               BLOCK_D=triton.next_power_of_2(D), num_warps=4)
