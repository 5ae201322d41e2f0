"""Rotary embedding (neox layout, optionally after Qwen3's per-head RMSNorm of q and k) and the KV store.

Rotary may write the rotated k and v straight into the KV pool (kv_store), so no separate KV-store kernel
runs; the jit helpers rope_consts and rope_rows are shared with the decode attention kernel, which applies
rotary itself (kernel/triton/attention.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import gdc_begin, launch_opts, pdl


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
def rope_rows(base, rows, stride_row, row_mask, w_ptr, eps, cos, sin, partner, sign, dims, D):
    """Rows base[rows] ([R, D] head vectors) rotated: x[d] * cos[d] + sign[d] * x[partner[d]] * sin[d], in
    float32 (the caller rounds). With w_ptr (Qwen3's q/k norm) each row is first RMS-normalised and scaled
    by w, rounded as reference.rms_norm does."""
    mask = row_mask[:, None] & (dims[None, :] < D)
    ptrs = base + rows[:, None] * stride_row
    x = tl.load(ptrs + dims[None, :], mask=mask, other=0.0)
    xp = tl.load(ptrs + partner[None, :], mask=mask, other=0.0)
    if w_ptr is not None:
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
                  sin, partner, sign, D, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[token, h] = rope_rows(x[token, h]) for every head h at once."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    out = rope_rows(x_ptr + token * stride_xt, heads, stride_xh, heads < num_heads, w_ptr, eps, cos, sin, partner,
                    sign, dims, D)
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(heads[:, None] < num_heads) & (dims[None, :] < D))


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cache_ptr, q_w_ptr, k_w_ptr, eps, stride_qt,
                   stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cache,
                   v_ptr, v_cache_ptr, loc_ptr, stride_vt, stride_vh, stride_ct, stride_ch, Hq, Hk, D, HALF,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """One token per program: rotates the first 2*HALF dims of every q and k head (neox layout: dim d
    pairs with d + HALF) and copies the rest; with q_w_ptr/k_w_ptr: RMSNorm each head first (Qwen3).
    With v_ptr (the KV store): the rotated k goes straight into the KV pool row loc[token] (k_out_ptr is
    the K cache) and v is copied into the V cache there, so no separate KV-store kernel runs."""
    gdc_begin(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    cos, sin, partner, sign = rope_consts(cache_ptr, stride_cache, pos, dims, HALF)
    _rotate_heads(q_ptr, q_out_ptr, q_w_ptr, eps, stride_qt, stride_qh, stride_qot, stride_qoh, token, Hq, cos,
                  sin, partner, sign, D, BLOCK_HQ, BLOCK_D)
    if v_ptr is not None:
        slot = tl.load(loc_ptr + token).to(tl.int64)  # int64: slot * row size overflows int32 in large pools
        # the K cache row of this token stands in for k_out[token] (a token stride of 0)
        _rotate_heads(k_ptr, k_out_ptr + slot * stride_ct, k_w_ptr, eps, stride_kt, stride_kh, 0, stride_ch, token,
                      Hk, cos, sin, partner, sign, D, BLOCK_HK, BLOCK_D)
        heads = tl.arange(0, BLOCK_HK)
        mask = (heads[:, None] < Hk) & (dims[None, :] < D)
        v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
        tl.store(v_cache_ptr + slot * stride_ct + heads[:, None] * stride_ch + dims[None, :],
                 v.to(v_cache_ptr.dtype.element_ty), mask=mask)
    else:
        _rotate_heads(k_ptr, k_out_ptr, k_w_ptr, eps, stride_kt, stride_kh, stride_kot, stride_koh, token, Hk, cos,
                      sin, partner, sign, D, BLOCK_HK, BLOCK_D)


def _rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
            q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
            kv_store: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "rotary needs a unit stride on the head dim"
    T, Hq, D = q.shape
    Hk = k.shape[1]
    half = cos_sin_cache.shape[-1] // 2
    assert 2 * half <= D and cos_sin_cache.stride(-1) == 1
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if kv_store is not None:
        k_cache, v_cache, out_loc, v = kv_store
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and v.stride(-1) == 1
        k_out, stride_kot, stride_koh = k_cache, None, None
        store_args = (v, v_cache, out_loc, v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1))
    else:
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        stride_kot, stride_koh = k_out.stride(0), k_out.stride(1)
        store_args = (None,) * 7
    if T:
        _rotary_kernel[(T,)](q, k, q_out, k_out, positions, cos_sin_cache, q_weight, k_weight, eps, q.stride(0),
                             q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1), stride_kot,
                             stride_koh, cos_sin_cache.stride(0), *store_args, Hq, Hk, D, half,
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
