"""Paged attention kernels: split-KV decode (with rotary and the KV store fused in) and prefill/extend
over a cached prefix, both reading K/V through the per-token page table (so any page size works unchanged).

Decode runs in two stages. Stage 1 (decode_split) has one program per (request, KV head, split): it loads
the query heads of that KV head's GQA group together, so each K/V row is read once, and it writes a
partial output plus the split's log-sum-exp. Stage 2 (merge_splits) merges the splits of each (request,
query head); with one split stage 1 writes the output itself and stage 2 is skipped, and the GEMV of the
output projection may merge the splits instead (gemv.gemv_merged). Given the rotary of the layer, stage 1
also applies it (and Qwen3's q/k norm) to q and the new k and stores the new K/V.

Prefill/extend (extend_attention) is one flash-attention launch over the new tokens of every request: a
program owns a tile of one request's new queries (a (request, query tile) entry of a work list built on
the host) for one query head, streams the keys 0..prefix+i through the page table with an online
softmax, and applies the causal mask only on the tiles that cross the diagonal.

attention/triton_backend.py plans the launches (split counts, tiles, buffers, CUDA graphs)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from minisgl.env import ENV

from .launch import gdc_begin, launch_opts, pdl
from .rotary import rope_consts, rope_rows

if TYPE_CHECKING:
    from minisgl.kernel.args import Rope

_MERGE_ROWS = 32  # (head, split) rows of partial outputs one merge program holds
_LOG2E = 1.4426950408889634
# a float8 pool's V converted to fp16 before the PV dots (_e4m3_quarters; MINISGL_FP8_V_BYTES=1: after, as
# before 2026-12-03); on a GPU from 32-bit words by cvt, which Triton's interpreter does not run
_V_WORDS = tl.constexpr(not ENV.fp8_v_bytes)
_CVT_ASM = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


# ---- decode --------------------------------------------------------------------------------------------
@triton.jit
def _store_new_kv(k_row, v_row, stride_knh, stride_vnh, k_cache_ptr, v_cache_ptr, stride_kt, stride_kh,
                  stride_vt, stride_vh, slot, kv_head, kw_ptr, eps, cos, sin, partner, sign, dims, D):
    """Rotate the new key of kv_head (k_row: the request's row of the projection's k; first RMS-normalised
    with kw_ptr, Qwen3) and store it and the new value (v_row) in pool row slot."""
    dim_mask = dims < D
    one = tl.arange(0, 1)
    k_new = rope_rows(k_row, kv_head + one, stride_knh, one == 0, kw_ptr, eps, cos, sin, partner, sign, dims, D)
    # k_new is [1, BLOCK_D]: one[:, None] (= 0) gives the pointers the same shape
    tl.store(k_cache_ptr + slot * stride_kt + kv_head * stride_kh + one[:, None] + dims[None, :],
             k_new.to(k_cache_ptr.dtype.element_ty), mask=dim_mask[None, :])
    v_new = tl.load(v_row + kv_head * stride_vnh + dims, mask=dim_mask)
    tl.store(v_cache_ptr + slot * stride_vt + kv_head * stride_vh + dims, v_new.to(v_cache_ptr.dtype.element_ty),
             mask=dim_mask)


@triton.jit
def _attend_split(q, k_cache_ptr, v_cache_ptr, pt_row_ptr, start, end, kv_head, stride_kt, stride_kh, stride_vt,
                  stride_vh, scale_log2, dims, dim_mask, D, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax of the query heads q [BLOCK_H, BLOCK_D] over keys start..end of one request:
    (running max, running sum, unnormalised output), in float32. The dots take q's dtype (the caller
    casts q: fp16 over a float8 pool, whose values convert to fp16 in one instruction). A float8 e4m3 V
    goes through _e4m3_quarters (heads of 64 dims and more)."""
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if _V_WORDS and v_cache_ptr.dtype.element_ty == tl.float8e4nv and BLOCK_D >= 64:
        # one accumulator per dim class d % 4 (acc_r[:, i] is dim 4i + r), interleaved at the end
        acc0 = tl.zeros([BLOCK_H, BLOCK_D // 4], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_H, BLOCK_D // 4], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_H, BLOCK_D // 4], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_H, BLOCK_D // 4], dtype=tl.float32)
        word_mask = tl.arange(0, BLOCK_D // 4) < D // 4  # the row's 32-bit words (D % 4 == 0)
        for n0 in range(start, end, BLOCK_N):
            slots, key_mask, p, alpha, m_i, l_i = _block_scores(q, k_cache_ptr, pt_row_ptr, n0, end, kv_head,
                                                                stride_kt, stride_kh, scale_log2, dims, dim_mask,
                                                                m_i, l_i, BLOCK_N, PRECISION)
            v0, v1, v2, v3 = _e4m3_quarters(v_cache_ptr + slots[:, None] * stride_vt + kv_head * stride_vh,
                                            key_mask[:, None] & word_mask[None, :], BLOCK_D)
            p = p.to(q.dtype)
            acc0 = acc0 * alpha[:, None] + tl.dot(p, v0.to(q.dtype), input_precision=PRECISION)
            acc1 = acc1 * alpha[:, None] + tl.dot(p, v1.to(q.dtype), input_precision=PRECISION)
            acc2 = acc2 * alpha[:, None] + tl.dot(p, v2.to(q.dtype), input_precision=PRECISION)
            acc3 = acc3 * alpha[:, None] + tl.dot(p, v3.to(q.dtype), input_precision=PRECISION)
        # [head, i, a, b] is dim 4i + 2a + b
        acc = tl.reshape(tl.join(tl.join(acc0, acc2), tl.join(acc1, acc3)), [BLOCK_H, BLOCK_D])
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            slots, key_mask, p, alpha, m_i, l_i = _block_scores(q, k_cache_ptr, pt_row_ptr, n0, end, kv_head,
                                                                stride_kt, stride_kh, scale_log2, dims, dim_mask,
                                                                m_i, l_i, BLOCK_N, PRECISION)
            v = tl.load(v_cache_ptr + slots[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
                        mask=key_mask[:, None] & dim_mask[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return m_i, l_i, acc


@triton.jit
def _block_scores(q, k_cache_ptr, pt_row_ptr, n0, end, kv_head, stride_kt, stride_kh, scale_log2, dims, dim_mask,
                  m_i, l_i, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """The key block at n0 of the online softmax: its pool slots, which of its keys are before end, the
    probabilities p (against the new running max), the old sum's rescale alpha, the new max and sum."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    key_mask = offs_n < end
    slots = tl.load(pt_row_ptr + offs_n, mask=key_mask, other=0).to(tl.int64)
    k = tl.load(k_cache_ptr + slots[:, None] * stride_kt + kv_head * stride_kh + dims[None, :],
                mask=key_mask[:, None] & dim_mask[None, :], other=0.0)
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale_log2
    qk = tl.where(key_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: every block in the loop holds a real key
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    return slots, key_mask, p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _e4m3_quarters(rows, mask, BLOCK_D: tl.constexpr):
    """A block of float8 e4m3 V rows (rows: each key's first byte) as four fp16 [keys, BLOCK_D // 4], dims
    4i, 4i + 1, 4i + 2 and 4i + 3. A float8 tl.load feeding a dot is converted after Triton moves it into
    the dot's operand layout, and 8-bit values have no transposing ldmatrix, so V was transposed a byte
    at a time; converted first, it reaches that layout as fp16, which ldmatrix transposes. On a GPU each
    32-bit word (mask: [keys, BLOCK_D // 4]) converts in two cvt instructions, an fp16 pair each; the
    interpreter reads the four classes byte by byte."""
    words = tl.arange(0, BLOCK_D // 4)
    if _CVT_ASM:
        w = tl.load(rows.to(tl.pointer_type(tl.int32)) + words[None, :], mask=mask, other=0)
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h; }",
            "=r,=r,r", [w], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        v0, v1, v2, v3 = _half(lo), _half(lo >> 16), _half(hi), _half(hi >> 16)
    else:
        first = rows + 4 * words[None, :]  # each word's first byte
        v0 = tl.load(first, mask=mask, other=0.0).to(tl.float16)
        v1 = tl.load(first + 1, mask=mask, other=0.0).to(tl.float16)
        v2 = tl.load(first + 2, mask=mask, other=0.0).to(tl.float16)
        v3 = tl.load(first + 3, mask=mask, other=0.0).to(tl.float16)
    return v0, v1, v2, v3


@triton.jit
def _half(bits):
    """The fp16 whose bit pattern is the low 16 bits of bits (int32)."""
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, table_idx_ptr, seq_lens_ptr,
                         mid_o_ptr, mid_lse_ptr, stride_qb, stride_qh, stride_kt, stride_kh, stride_vt,
                         stride_vh, stride_pt, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                         scale_log2, GROUP, D, NUM_SPLITS, k_ptr, v_ptr, stride_kb, stride_knh, stride_vb,
                         stride_vnh, loc_ptr, pos_ptr, cache_ptr, stride_cache, qw_ptr, kw_ptr, eps, HALF,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         PRECISION: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr):
    """Program (KV head x split, request b): _attend_program."""
    gdc_begin(PDL)
    # (KV head, split) varies fastest, so programs start request by request in batch order: the scheduler
    # puts the longest requests first and the shortest programs fill the last wave
    _attend_program(q_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, table_idx_ptr, seq_lens_ptr, mid_o_ptr,
                    mid_lse_ptr, stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pt,
                    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, scale_log2, GROUP, D, NUM_SPLITS, k_ptr,
                    v_ptr, stride_kb, stride_knh, stride_vb, stride_vnh, loc_ptr, pos_ptr, cache_ptr, stride_cache,
                    qw_ptr, kw_ptr, eps, HALF, tl.program_id(1), tl.program_id(0) // NUM_SPLITS,
                    tl.program_id(0) % NUM_SPLITS, BLOCK_H, BLOCK_N, BLOCK_D, PRECISION, DOT)


@triton.jit
def _attend_program(q_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, table_idx_ptr, seq_lens_ptr, mid_o_ptr,
                    mid_lse_ptr, stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pt,
                    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, scale_log2, GROUP, D, NUM_SPLITS, k_ptr,
                    v_ptr, stride_kb, stride_knh, stride_vb, stride_vnh, loc_ptr, pos_ptr, cache_ptr, stride_cache,
                    qw_ptr, kw_ptr, eps, HALF, b, kv_head, split, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr):
    """Attend the GROUP query heads of kv_head for request b over the keys of one split; write the
    normalised partial output and its log2-sum-exp. A split past the sequence's end writes nothing (the
    merge reads only the splits that hold keys). Without mid_lse_ptr (one split) the output itself goes
    to mid_o_ptr, in its dtype, and there is no merge.
    With cache_ptr (the rotary's cos|sin table) q, k and v are the projection's raw outputs: q is rotated
    here (after a per-head RMSNorm with qw_ptr/kw_ptr, Qwen3), and the split holding the new key rotates k
    and writes k and v into the pool row loc[b] before reading its keys, so no rotary or KV-store kernel
    runs before this one. (Also the attention stage of the layer kernel, kernel/triton/layer.py.)"""
    seq_len = tl.load(seq_lens_ptr + b)
    # split lengths are whole key blocks, so only the sequence's last block needs a bounds mask
    chunk = _split_len(seq_len, NUM_SPLITS, BLOCK_N)
    start = split * chunk
    # graphs fix the split count for max_seq_len: most splits are empty at short lengths
    if start < seq_len:
        end = tl.minimum(start + chunk, seq_len)
        row = tl.load(table_idx_ptr + b).to(tl.int64)

        offs_h = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + offs_h
        head_mask = offs_h < GROUP
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < D
        if cache_ptr is not None:
            pos = tl.load(pos_ptr + b).to(tl.int64)
            cos, sin, partner, sign = rope_consts(cache_ptr, stride_cache, pos, dims, HALF)
            q = rope_rows(q_ptr + b.to(tl.int64) * stride_qb, heads, stride_qh, head_mask, qw_ptr, eps, cos, sin,
                          partner, sign, dims, D).to(q_ptr.dtype.element_ty)
            if end == seq_len:  # this split holds the new key: rotate it and store it (and v) first
                slot = tl.load(loc_ptr + b).to(tl.int64)
                _store_new_kv(k_ptr + b.to(tl.int64) * stride_kb, v_ptr + b.to(tl.int64) * stride_vb, stride_knh,
                              stride_vnh, k_cache_ptr, v_cache_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                              slot, kv_head, kw_ptr, eps, cos, sin, partner, sign, dims, D)
                tl.debug_barrier()  # the stores are visible to every thread of the program before the loads below
        else:
            q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                        mask=head_mask[:, None] & dim_mask[None, :], other=0.0)

        if DOT is not None:
            q = q.to(DOT)
        m_i, l_i, acc = _attend_split(q, k_cache_ptr, v_cache_ptr, page_table_ptr + row * stride_pt, start, end,
                                      kv_head, stride_kt, stride_kh, stride_vt, stride_vh, scale_log2, dims,
                                      dim_mask, D, BLOCK_H, BLOCK_N, BLOCK_D, PRECISION)
        out = acc / l_i[:, None]
        mid = (mid_o_ptr + b.to(tl.int64) * stride_mb + heads[:, None] * stride_mh + split * stride_ms
               + dims[None, :])
        tl.store(mid, out.to(mid_o_ptr.dtype.element_ty), mask=head_mask[:, None] & dim_mask[None, :])
        if mid_lse_ptr is not None:
            lse = m_i + tl.log2(l_i)  # l_i >= 1: the split holds at least one key
            tl.store(mid_lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=head_mask)


@triton.jit
def _split_len(seq_len, NUM_SPLITS, BLOCK_N: tl.constexpr):
    """Keys per split: the sequence over NUM_SPLITS, rounded up to whole key blocks."""
    return tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N


@triton.jit
def _decode_merge_kernel(mid_o_ptr, mid_lse_ptr, out_ptr, seq_lens_ptr, stride_mb, stride_mh, stride_ms,
                         stride_lb, stride_lh, stride_ob, stride_oh, NUM_SPLITS, D, BLOCK_N: tl.constexpr,
                         HEADS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Program (request, HEADS query heads): out = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse),
    over the splits that hold keys (stage 1 wrote nothing for the others)."""
    gdc_begin(PDL)
    b = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # HEADS divides the head count: no mask
    seq_len = tl.load(seq_lens_ptr + b)
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < tl.cdiv(seq_len, _split_len(seq_len, NUM_SPLITS, BLOCK_N))
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < D
    lse = tl.load(mid_lse_ptr + b * stride_lb + heads[:, None] * stride_lh + splits[None, :],
                  mask=split_mask[None, :], other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 1)[:, None])  # masked splits (-inf) weigh 0; split 0 always holds keys
    o = tl.load(mid_o_ptr + b * stride_mb + heads[:, None, None] * stride_mh + splits[None, :, None] * stride_ms
                + dims[None, None, :], mask=split_mask[None, :, None] & dim_mask[None, None, :], other=0.0)
    out = tl.sum(weight[:, :, None] * o, 1) / tl.sum(weight, 1)[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=dim_mask[None, :])


# ---- prefill / extend ----------------------------------------------------------------------------------
@triton.jit
def _attend_block(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, pt_row_ptr, n0, kv_head, stride_kt, stride_kh,
                  stride_vt, stride_vh, scale_log2, dims, dim_mask, q_pos, kv_end, CAUSAL: tl.constexpr,
                  BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """One key block of the online softmax. CAUSAL: the block crosses the diagonal or the sequence end,
    so keys past a query's position (or past kv_end) are masked; otherwise every key is visible. The dots
    take q's dtype, as in _attend_split."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if CAUSAL:
        key_mask = offs_n < kv_end
        slots = tl.load(pt_row_ptr + offs_n, mask=key_mask, other=0).to(tl.int64)
        kv_mask = key_mask[:, None] & dim_mask[None, :]
    else:
        slots = tl.load(pt_row_ptr + offs_n).to(tl.int64)
        kv_mask = dim_mask[None, :]
    k = tl.load(k_cache_ptr + slots[:, None] * stride_kt + kv_head * stride_kh + dims[None, :], mask=kv_mask,
                other=0.0)
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale_log2
    if CAUSAL:
        visible = (offs_n[None, :] <= q_pos[:, None]) & key_mask[None, :]
        qk = tl.where(visible, qk, float("-inf"))
    # m_i is finite after the first block: key 0 is visible to every query and comes first
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + slots[:, None] * stride_vt + kv_head * stride_vh + dims[None, :], mask=kv_mask,
                other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _extend_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, page_table_ptr, table_idx_ptr, q_start_ptr,
                   prefix_ptr, extend_ptr, tile_req_ptr, tile_m_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_vt, stride_vh, stride_ot, stride_oh, stride_pt, scale_log2, GROUP, D,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
                   DOT: tl.constexpr, PDL: tl.constexpr):
    """Program (work tile, query head): the tile is query tile tile_m of request b = tile_req (b < 0: a
    padding tile of a CUDA graph, nothing to do). New query i of b sits at position prefix + i and sees
    keys 0..prefix + i, all read from the pool (the new ones are stored already)."""
    gdc_begin(PDL)
    tile = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.load(tile_req_ptr + tile)
    if b < 0:
        return
    m_start = tl.load(tile_m_ptr + tile) * BLOCK_M
    extend = tl.load(extend_ptr + b)
    prefix = tl.load(prefix_ptr + b)
    q_start = tl.load(q_start_ptr + b).to(tl.int64)
    row = tl.load(table_idx_ptr + b).to(tl.int64)
    kv_head = head // GROUP

    offs_m = m_start + tl.arange(0, BLOCK_M)
    row_mask = offs_m < extend
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < D
    q_rows = q_start + offs_m
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if DOT is not None:
        q = q.to(DOT)
    q_pos = prefix + offs_m
    pt_row_ptr = page_table_ptr + row * stride_pt

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # keys 0..prefix + m_start are visible to every query of the tile: whole blocks of them need no mask
    full_end = (prefix + m_start + 1) // BLOCK_N * BLOCK_N
    kv_end = prefix + tl.minimum(m_start + BLOCK_M, extend)
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, pt_row_ptr, n0, kv_head,
                                      stride_kt, stride_kh, stride_vt, stride_vh, scale_log2, dims, dim_mask,
                                      q_pos, kv_end, False, BLOCK_N, PRECISION)
    for n0 in range(full_end, kv_end, BLOCK_N):  # the diagonal: at most BLOCK_M / BLOCK_N + 1 blocks
        m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, pt_row_ptr, n0, kv_head,
                                      stride_kt, stride_kh, stride_vt, stride_vh, scale_log2, dims, dim_mask,
                                      q_pos, kv_end, True, BLOCK_N, PRECISION)
    out = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])



# ---- launches ----------------------------------------------------------------------------------------------
def _dot_dtype(q: torch.Tensor, k_cache: torch.Tensor):
    """The attention dots' dtype where it is not q's: fp16 for bf16 queries over a float8 pool (float8 e4m3
    converts to fp16 in one instruction, to bf16 through float32; q, the probabilities and the pool's
    values all fit fp16, with more mantissa than bf16's)."""
    return tl.float16 if k_cache.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16 else None


def decode_split(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                 table_idx: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                 num_splits: int, scale: float, *, block_n: int, precision: str, num_warps: int, num_stages: int,
                 new_kv: tuple[Rope, torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """Stage 1 of split-KV paged decode for q [B, Hq, D] over the pool rows page_table[table_idx] of
    seq_lens keys: each split's normalised output goes to out [B, Hq, num_splits, D] and its log2-sum-exp
    to lse [B, Hq, num_splits]; with one split (lse None) out ([B, Hq, 1, D]) is the attention output.
    new_kv = (rope, k, v, out_loc): q and k are not rotated yet; the kernel applies rope to q and to the new
    k, and stores k and v in the pool rows out_loc before it reads them."""
    bs, _, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = q.shape[1] // num_kv_heads
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1
    # a float8 V is read in 32-bit words (_e4m3_quarters): whole words per head, rows 4-byte aligned
    assert v_cache.element_size() > 1 or (head_dim % 4 == 0 and v_cache.stride(0) % 4 == v_cache.stride(1) % 4 == 0)
    if new_kv is not None:
        rope, k, v, out_loc = new_kv
        assert k.stride(-1) == 1 and v.stride(-1) == 1
        cache = rope.cos_sin_cache
        rope_args = (k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), out_loc, rope.positions, cache,
                     cache.stride(0), rope.q_weight, rope.k_weight, rope.eps, cache.shape[-1] // 2)
    else:
        rope_args = (None,) * 14
    lse_strides = (None, None) if lse is None else (lse.stride(0), lse.stride(1))
    _decode_split_kernel[(num_kv_heads * num_splits, bs)](
        q, k_cache, v_cache, page_table, table_idx, seq_lens, out, lse, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), page_table.stride(0), out.stride(0), out.stride(1),
        out.stride(2), *lse_strides, scale * _LOG2E, group, head_dim, num_splits, *rope_args,
        BLOCK_H=max(16, triton.next_power_of_2(group)),  # tl.dot needs >= 16 rows on a GPU
        BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim), PRECISION=precision, DOT=_dot_dtype(q, k_cache),
        PDL=pdl(q), num_warps=num_warps, num_stages=num_stages, **launch_opts(q))


def merge_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, seq_lens: torch.Tensor, num_splits: int,
                 out: torch.Tensor, block_n: int) -> torch.Tensor:
    """Stage 2 of split-KV decode: out [B, Hq, D] = the splits decode_split cut (whole blocks of block_n
    keys) merged by their log-sum-exps; returns out."""
    bs, num_heads = out.shape[:2]
    block_s = triton.next_power_of_2(num_splits)
    # a program merges several heads (fewer, fuller programs), the largest power of two dividing the head
    # count with at most _MERGE_ROWS (head, split) rows of partial outputs in registers
    heads = min(num_heads & -num_heads, max(1, _MERGE_ROWS // block_s))
    _decode_merge_kernel[(bs, num_heads // heads)](
        mid_o, mid_lse, out, seq_lens, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
        mid_lse.stride(1), out.stride(0), out.stride(1), num_splits, out.shape[2], BLOCK_N=block_n, HEADS=heads,
        BLOCK_S=block_s, BLOCK_D=triton.next_power_of_2(out.shape[2]), PDL=pdl(out), num_warps=4,
        **launch_opts(out))
    return out


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     table_idx: torch.Tensor, q_start: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, tile_req: torch.Tensor, tile_m: torch.Tensor, num_tiles: int,
                     scale: float, *, blocks: tuple[int, int], precision: str, num_warps: int,
                     num_stages: int) -> torch.Tensor:
    """Causal attention of the new tokens q [T, Hq, D] of every request (rows q_start.. of q, at positions
    prefix_lens..) over keys 0..position in the pool, one program per (work tile, query head); the work
    list (tile_req, tile_m) holds num_tiles (request, query tile of blocks[0] rows) entries."""
    head_dim = q.shape[2]
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block_m, block_n = blocks
    _extend_kernel[(num_tiles, q.shape[1])](
        q, k_cache, v_cache, out, page_table, table_idx, q_start, prefix_lens, extend_lens, tile_req, tile_m,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), page_table.stride(0), scale * _LOG2E, q.shape[1] // k_cache.shape[1], head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim), PRECISION=precision,
        DOT=_dot_dtype(q, k_cache), PDL=pdl(q), num_warps=num_warps, num_stages=num_stages, **launch_opts(q))
    return out
