"""The Triton attention backend, the default on CUDA: paged decode with split KV, and prefill/extend over a
cached prefix, both reading K/V through the per-token page table (so any page size works unchanged).

Decode runs in two stages. Stage 1 has one program per (request, KV head, split): it loads the query heads
of that KV head's GQA group together, so each K/V row is read once, and it writes a partial output plus
the split's log-sum-exp. Stage 2 merges the splits of each (request, query head). The number of splits is
chosen so the first stage fills the GPU several times over even at batch size 1; with one split (large
batches) stage 1 writes the output itself and stage 2 is skipped; with one request the output projection
may merge the splits itself (defer_merge: a kernel.SplitAttention goes back instead). Given a Rope, stage
1 also applies rotary (and Qwen3's q/k norm) to q and the new k and stores the new K/V (fuses_rope).

Prefill/extend is one flash-attention launch over the new tokens of every request: a program owns a tile
of one request's new queries (a (request, query tile) entry of a work list built on the host) for one
query head, streams the keys 0..prefix+i through the page table with an online softmax, and applies the
causal mask only on the tiles that cross the diagonal. Prefill CUDA graphs keep the metadata and the work
list in a fixed buffer (init_prefill_graph / prepare_prefill_capture / prepare_prefill_replay).

Also runs on CPU tensors under TRITON_INTERPRET=1 (the CPU tests), with smaller tiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import triton
import triton.language as tl

from minisgl.kernel import Rope, SplitAttention
from minisgl.kernel.triton import gemm as triton_ops
from minisgl.kernel.triton.gemm import gdc_begin, rope_consts, rope_rows
from minisgl.utils.device import HostRing

from .base import AttnConfig, BaseAttnBackend

if TYPE_CHECKING:
    from minisgl.core import Batch
    from minisgl.kvcache.pool import KVPool

_LOG2E = 1.4426950408889634
_WAVES = 8  # stage-1 programs per SM to aim for: many waves hide the tail of uneven splits (W1: 4 -> 8, +1%)
_MAX_SPLITS = 64  # beyond this, stage 2 costs more than the extra parallelism gains


# ---- decode --------------------------------------------------------------------------------------------
@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, table_idx_ptr, seq_lens_ptr,
                         mid_o_ptr, mid_lse_ptr, stride_qb, stride_qh, stride_kt, stride_kh, stride_vt,
                         stride_vh, stride_pt, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                         scale_log2, GROUP, D, NUM_SPLITS, k_ptr, v_ptr, stride_kb, stride_knh, stride_vb,
                         stride_vnh, loc_ptr, pos_ptr, cache_ptr, stride_cache, qw_ptr, kw_ptr, eps, HALF,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         PRECISION: tl.constexpr, DIRECT: tl.constexpr, ROPE: tl.constexpr, NORM: tl.constexpr,
                         PDL: tl.constexpr):
    """Program (KV head x split, request b): attend the GROUP query heads of this KV head over the split's
    keys; write the normalised partial output and its log2-sum-exp. A split past the sequence's end writes
    nothing (the merge reads only the splits that hold keys). DIRECT (one split): the output itself goes
    to mid_o_ptr, in its dtype, and there is no merge.
    ROPE: q, k and v are the projection's raw outputs: q is rotated here (after a per-head RMSNorm when
    NORM, Qwen3), and the split holding the new key rotates k and writes k and v into the pool row
    loc[b] before reading its keys, so no rotary or KV-store kernel runs before this one."""
    gdc_begin(PDL)
    # (KV head, split) varies fastest, so programs start request by request in batch order: the scheduler
    # puts the longest requests first and the shortest programs fill the last wave
    b = tl.program_id(1)
    kv_head = tl.program_id(0) // NUM_SPLITS
    split = tl.program_id(0) % NUM_SPLITS
    seq_len = tl.load(seq_lens_ptr + b)
    # split lengths are whole key blocks, so only the sequence's last block needs a bounds mask
    chunk = _split_len(seq_len, NUM_SPLITS, BLOCK_N)
    start = split * chunk
    if start >= seq_len:  # graphs fix the split count for max_seq_len: most splits are empty at short lengths
        return
    end = tl.minimum(start + chunk, seq_len)
    row = tl.load(table_idx_ptr + b).to(tl.int64)

    offs_h = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_h
    head_mask = offs_h < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < D
    if ROPE:
        pos = tl.load(pos_ptr + b).to(tl.int64)
        cos, sin, partner, sign = rope_consts(cache_ptr, stride_cache, pos, dims, HALF)
        q = rope_rows(q_ptr + b.to(tl.int64) * stride_qb, heads, stride_qh, head_mask, qw_ptr, eps, cos, sin,
                      partner, sign, dims, D, NORM).to(q_ptr.dtype.element_ty)
        if end == seq_len:  # this split holds the new key: rotate it and store it (and v) first
            slot = tl.load(loc_ptr + b).to(tl.int64)
            one = tl.arange(0, 1)
            k_new = rope_rows(k_ptr + b.to(tl.int64) * stride_kb, kv_head + one, stride_knh, one == 0, kw_ptr, eps,
                              cos, sin, partner, sign, dims, D, NORM)
            # k_new is [1, BLOCK_D]: one[:, None] (= 0) gives the pointers the same shape
            tl.store(k_cache_ptr + slot * stride_kt + kv_head * stride_kh + one[:, None] + dims[None, :],
                     k_new.to(k_cache_ptr.dtype.element_ty), mask=dim_mask[None, :])
            v_new = tl.load(v_ptr + b.to(tl.int64) * stride_vb + kv_head * stride_vnh + dims, mask=dim_mask)
            tl.store(v_cache_ptr + slot * stride_vt + kv_head * stride_vh + dims,
                     v_new.to(v_cache_ptr.dtype.element_ty), mask=dim_mask)
            tl.debug_barrier()  # the stores are visible to every thread of the program before the loads below
    else:
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                    mask=head_mask[:, None] & dim_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        key_mask = offs_n < end
        slots = tl.load(page_table_ptr + row * stride_pt + offs_n, mask=key_mask, other=0).to(tl.int64)
        kv_mask = key_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + slots[:, None] * stride_kt + kv_head * stride_kh + dims[None, :],
                    mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale_log2
        qk = tl.where(key_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: every block in the loop holds a real key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + slots[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    mid = mid_o_ptr + b.to(tl.int64) * stride_mb + heads[:, None] * stride_mh + split * stride_ms + dims[None, :]
    tl.store(mid, out.to(mid_o_ptr.dtype.element_ty), mask=head_mask[:, None] & dim_mask[None, :])
    if not DIRECT:
        lse = m_i + tl.log2(l_i)  # l_i >= 1: the split holds at least one key
        tl.store(mid_lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=head_mask)


@triton.jit
def _split_len(seq_len, NUM_SPLITS, BLOCK_N: tl.constexpr):
    """Keys per split: the sequence over NUM_SPLITS, rounded up to whole key blocks."""
    return tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N


@triton.jit
def _decode_merge_kernel(mid_o_ptr, mid_lse_ptr, out_ptr, seq_lens_ptr, stride_mb, stride_mh, stride_ms,
                         stride_lb, stride_lh, stride_ob, stride_oh, NUM_SPLITS, D, BLOCK_N: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Program (request, query head): out = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse), over
    the splits that hold keys (stage 1 wrote nothing for the others)."""
    gdc_begin(PDL)
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < tl.cdiv(seq_len, _split_len(seq_len, NUM_SPLITS, BLOCK_N))
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < D
    lse = tl.load(mid_lse_ptr + b * stride_lb + head * stride_lh + splits, mask=split_mask, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # masked splits (-inf) weigh 0; split 0 always holds keys
    o = tl.load(mid_o_ptr + b * stride_mb + head * stride_mh + splits[:, None] * stride_ms + dims[None, :],
                mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    out = tl.sum(weight[:, None] * o, 0) / tl.sum(weight, 0)
    tl.store(out_ptr + b * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


# ---- prefill / extend ----------------------------------------------------------------------------------
@triton.jit
def _attend_block(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, pt_row_ptr, n0, kv_head, stride_kt, stride_kh,
                  stride_vt, stride_vh, scale_log2, dims, dim_mask, q_pos, kv_end, CAUSAL: tl.constexpr,
                  BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """One key block of the online softmax. CAUSAL: the block crosses the diagonal or the sequence end,
    so keys past a query's position (or past kv_end) are masked; otherwise every key is visible."""
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
                   PDL: tl.constexpr):
    """Program (work tile, query head): the tile is query tile tile_m of request b = tile_req (b < 0: a
    padding tile of a CUDA graph, nothing to do). New query i of b sits at position prefix + i and sees
    keys 0..prefix + i, all read from the pool (store_kv has written the new ones already)."""
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


# ---- the backend ---------------------------------------------------------------------------------------
@dataclass
class TritonDecodeMetadata:
    table_idx: torch.Tensor  # [B] page-table row of each request
    seq_lens: torch.Tensor  # [B] keys of each request, the new token included
    num_splits: int
    mid_o: torch.Tensor | None  # [B, Hq, num_splits, D] float32: each split's normalised partial output
    mid_lse: torch.Tensor | None  # [B, Hq, num_splits] float32: each split's log2-sum-exp (None: 1 split)


@dataclass
class TritonExtendMetadata:
    table_idx: torch.Tensor  # [B]
    q_start: torch.Tensor  # [B] first row of each request's new tokens in q (cu_seqlens without the end)
    prefix_lens: torch.Tensor  # [B] cached tokens before the new ones
    extend_lens: torch.Tensor  # [B] new tokens
    tile_req: torch.Tensor  # [num_tiles] request of each work tile (-1: padding)
    tile_m: torch.Tensor  # [num_tiles] its query tile within the request
    num_tiles: int  # sizes the grid


def extend_tiles(prefix_lens: np.ndarray, extend_lens: np.ndarray, block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """The extend kernel's work list: every (request, query tile) pair, those with the most keys first
    (the longest programs start in the first wave)."""
    counts = -(-extend_lens // block_m)
    req = np.repeat(np.arange(len(extend_lens)), counts)
    m = np.arange(len(req)) - np.repeat(np.cumsum(counts) - counts, counts)
    order = np.argsort(-(prefix_lens[req] + m * block_m), kind="stable")
    return req[order].astype(np.int32), m[order].astype(np.int32)


class TritonAttnBackend(BaseAttnBackend):
    """Split-KV paged decode and flash-attention extend in Triton; supports CUDA graphs for decode."""

    def __init__(self, config: AttnConfig, kv_pool: KVPool, page_table: torch.Tensor) -> None:
        super().__init__(config, kv_pool, page_table)
        assert config.num_heads % config.num_kv_heads == 0
        self.group = config.num_heads // config.num_kv_heads
        on_gpu = config.device.type == "cuda"
        if on_gpu:
            self.num_sms = torch.cuda.get_device_properties(config.device).multi_processor_count
            self.decode_block_n = 64
            # measured on an H200 (Qwen3-0.6B heads, bf16): 3 stages cut batch 64 x 1,500 keys (2 splits)
            # from 184 to 120 us a layer against 2 stages; 4 stages are best with one split (batch 256 x
            # 600 keys: 164 -> 157 us)
            self.decode_launch = {"num_warps": 4, "num_stages": (3, 4)}  # stages: (several splits, one)
            # measured on an H200 (Qwen3-0.6B heads, bf16, 16 x 512 / 8 x 1,024 / 4 x 512 on 1,536 cached):
            # 64 x 64 tiles, 4 warps, 2 stages took 99 / 152 / 116 us against 113 / 172 / 134 with 128 x 64
            # and 8 warps, the best of nine tilings (python -m minisgl.benchmark.attn_extend; W1 +0.4%)
            self.extend_blocks = (64, 64) if config.head_dim <= 128 else (64, 32)
            self.extend_launch = {"num_warps": 4, "num_stages": 2}
        else:  # TRITON_INTERPRET: small tiles, so short test sequences still cross several tiles and splits
            self.num_sms = 4
            self.decode_block_n = 16
            self.decode_launch = {"num_warps": 4, "num_stages": (2, 2)}
            self.extend_blocks = (16, 16)
            self.extend_launch = {"num_warps": 4, "num_stages": 2}
        # fp32 runs (the CPU-equality tests on a GPU) must not silently drop to TF32 inside tl.dot
        self.precision = "ieee" if config.dtype == torch.float32 else "tf32"
        self._staging = HostRing(config.device)  # pinned buffers for the extend metadata
        self._graph_splits: dict[int, int] = {}
        self._graph_mid_o: torch.Tensor | None = None
        self._graph_mid_lse: torch.Tensor | None = None

    # ---- metadata --------------------------------------------------------------------------------
    def num_splits(self, batch_size: int, max_seq_len: int) -> int:
        """Splits per (request, KV head): enough stage-1 programs for _WAVES per SM, at most one split
        per key block, capped at _MAX_SPLITS."""
        programs = batch_size * self.config.num_kv_heads
        wanted = triton.cdiv(self.num_sms * _WAVES, programs)
        blocks = triton.cdiv(max_seq_len, self.decode_block_n)
        return max(1, min(wanted, blocks, _MAX_SPLITS))

    def _decode_metadata(self, batch: Batch, num_splits: int, mid_o: torch.Tensor,
                         mid_lse: torch.Tensor) -> TritonDecodeMetadata:
        return TritonDecodeMetadata(batch.table_idx, batch.seq_lens_t, num_splits, mid_o, mid_lse)

    def prepare_metadata(self, batch: Batch) -> None:
        cfg, device = self.config, self.config.device
        if batch.is_decode:
            bs = batch.size
            splits = self.num_splits(bs, max(batch.seq_lens))  # host list: no device sync
            mid_o = mid_lse = None  # one split writes the output directly
            if splits > 1:
                mid_o = torch.empty((bs, cfg.num_heads, splits, cfg.head_dim), dtype=torch.float32, device=device)
                mid_lse = torch.empty((bs, cfg.num_heads, splits), dtype=torch.float32, device=device)
            batch.attn_metadata = self._decode_metadata(batch, splits, mid_o, mid_lse)
            return
        parts = self._extend_parts(batch)
        # each part 16-byte aligned (Triton specialises on pointer alignment: no recompiles per batch size)
        dev, offsets = self._staging.pack(parts)
        q_start, prefix_lens, extend_lens, tile_req, tile_m = (dev[off:off + len(p)] for off, p in zip(offsets, parts))
        batch.attn_metadata = TritonExtendMetadata(batch.table_idx, q_start, prefix_lens, extend_lens, tile_req,
                                                   tile_m, len(parts[3]))

    def _extend_parts(self, batch: Batch) -> list[np.ndarray]:
        """q_start, prefix_lens, extend_lens (per request), tile_req, tile_m (per work tile), on the host."""
        prefix = np.asarray(batch.prefix_lens, dtype=np.int32)
        extend = np.asarray(batch.extend_lens, dtype=np.int32)
        starts = (np.cumsum(extend) - extend).astype(np.int32)
        return [starts, prefix, extend, *extend_tiles(prefix, extend, self.extend_blocks[0])]

    # ---- compute ---------------------------------------------------------------------------------
    def kv_from_pool(self, batch: Batch) -> bool:
        return True  # both kernels read every key, the new ones included, from the pool

    def fuses_rope(self, batch: Batch) -> bool:
        return batch.is_decode  # the decode kernel rotates q and the new k and stores k/v itself

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor, layer_id: int, batch: Batch,
                stored: bool = False, rope: Rope | None = None,
                defer_merge: bool = False) -> torch.Tensor | SplitAttention:
        k_cache, v_cache = self.kv_pool.k(layer_id), self.kv_pool.v(layer_id)
        assert q.stride(-1) == 1 and k_cache.stride(-1) == 1
        if rope is not None:
            assert batch.is_decode and not stored and k.stride(-1) == 1 and v.stride(-1) == 1
            return self._decode(q, k_cache, v_cache, batch.attn_metadata, (rope, k, v, batch.out_loc), defer_merge)
        if not stored:
            triton_ops.store_kv(k_cache, v_cache, batch.out_loc, k, v)
        if batch.is_decode:
            return self._decode(q, k_cache, v_cache, batch.attn_metadata, None, defer_merge)
        return self._extend(q, k_cache, v_cache, batch.attn_metadata)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TritonDecodeMetadata,
                fused: tuple | None = None, defer_merge: bool = False) -> torch.Tensor | SplitAttention:
        """fused = (rope, k, v, out_loc): q, k, v are unrotated and the kernel rotates them and stores k/v.
        defer_merge: one request's several splits come back unmerged (SplitAttention) for the output
        projection's GEMV to merge."""
        bs, _, head_dim = q.shape
        mid_o, mid_lse, splits = meta.mid_o, meta.mid_lse, meta.num_splits
        block_d = triton.next_power_of_2(head_dim)
        block_h = max(16, triton.next_power_of_2(self.group))  # tl.dot needs >= 16 rows on a GPU
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        direct = splits == 1  # one split: stage 1 writes the output, no merge
        dst = out[:, :, None, :] if direct else mid_o
        lse = out if direct else mid_lse  # unused when direct
        pdl = triton_ops.pdl(q)
        if fused is not None:
            rope, k, v, out_loc = fused
            cache = rope.cos_sin_cache
            norm = rope.q_weight is not None
            rope_args = (k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), out_loc, rope.positions, cache,
                         cache.stride(0), rope.q_weight if norm else q, rope.k_weight if norm else q, rope.eps,
                         cache.shape[-1] // 2)
        else:
            norm = False
            rope_args = (q, q, 0, 0, 0, 0, meta.seq_lens, meta.seq_lens, q, 0, q, q, 0.0, 0)  # unused
        _decode_split_kernel[(self.config.num_kv_heads * splits, bs)](
            q, k_cache, v_cache, self.page_table, meta.table_idx, meta.seq_lens, dst, lse,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            self.page_table.stride(0), dst.stride(0), dst.stride(1), dst.stride(2), lse.stride(0),
            lse.stride(1), self.scale * _LOG2E, self.group, head_dim, splits, *rope_args, BLOCK_H=block_h,
            BLOCK_N=self.decode_block_n, BLOCK_D=block_d, PRECISION=self.precision, DIRECT=direct,
            ROPE=fused is not None, NORM=norm, PDL=pdl,
            num_warps=self.decode_launch["num_warps"], num_stages=self.decode_launch["num_stages"][direct],
            **triton_ops.launch_opts(q))
        if direct:
            return out
        if defer_merge and bs == 1:
            return SplitAttention(mid_o, mid_lse, meta.seq_lens, splits, self.decode_block_n, q.dtype,
                                  lambda: self._merge(mid_o, mid_lse, meta.seq_lens, splits, out).view(bs, -1))
        return self._merge(mid_o, mid_lse, meta.seq_lens, splits, out)

    def _merge(self, mid_o: torch.Tensor, mid_lse: torch.Tensor, seq_lens: torch.Tensor, splits: int,
               out: torch.Tensor) -> torch.Tensor:
        _decode_merge_kernel[out.shape[:2]](
            mid_o, mid_lse, out, seq_lens, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
            mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1), splits, out.shape[2],
            BLOCK_N=self.decode_block_n, BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_D=triton.next_power_of_2(out.shape[2]), PDL=triton_ops.pdl(out), num_warps=4,
            **triton_ops.launch_opts(out))
        return out

    def _extend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: TritonExtendMetadata) -> torch.Tensor:
        head_dim = q.shape[2]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        block_m, block_n = self.extend_blocks
        _extend_kernel[(meta.num_tiles, self.config.num_heads)](
            q, k_cache, v_cache, out, self.page_table, meta.table_idx, meta.q_start, meta.prefix_lens,
            meta.extend_lens, meta.tile_req, meta.tile_m, q.stride(0), q.stride(1), k_cache.stride(0),
            k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
            self.page_table.stride(0), self.scale * _LOG2E,
            self.group, head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
            PRECISION=self.precision, PDL=triton_ops.pdl(q), **self.extend_launch,
            **triton_ops.launch_opts(q))
        return out

    # ---- CUDA graphs (decode) --------------------------------------------------------------------
    def init_capture_graph(self, max_bs: int, capture_bs: list[int]) -> None:
        """Fix the split count of every captured size (sequence lengths are unknown at capture, so it
        assumes the longest) and allocate one partial-result buffer that the largest of them fits."""
        cfg = self.config
        self._graph_splits = {bs: self.num_splits(bs, cfg.max_seq_len) for bs in capture_bs}
        rows = max(bs * s for bs, s in self._graph_splits.items()) * cfg.num_heads
        self._graph_mid_o = torch.empty(rows * cfg.head_dim, dtype=torch.float32, device=cfg.device)
        self._graph_mid_lse = torch.empty(rows, dtype=torch.float32, device=cfg.device)

    def prepare_for_capture(self, batch: Batch) -> None:
        """batch's table_idx and seq_lens_t are the graph runner's fixed buffers; the metadata points at
        them and at views of this backend's fixed partial-result buffers."""
        assert self._graph_mid_o is not None, "init_capture_graph first"
        cfg, bs = self.config, batch.size
        splits = self._graph_splits[bs]
        n = bs * cfg.num_heads * splits
        mid_o = self._graph_mid_o[: n * cfg.head_dim].view(bs, cfg.num_heads, splits, cfg.head_dim)
        mid_lse = self._graph_mid_lse[:n].view(bs, cfg.num_heads, splits)
        batch.attn_metadata = self._decode_metadata(batch, splits, mid_o, mid_lse)

    def prepare_for_replay(self, batch: Batch) -> None:
        """Nothing to refresh: the captured kernels read the page table, the runner's table_idx and
        seq_lens buffers (refreshed by the runner before this call) and compute split bounds on the device."""
        assert batch.padded_size in self._graph_splits, f"batch size {batch.padded_size} was not captured"

    # ---- CUDA graphs (prefill) -------------------------------------------------------------------
    def _max_tiles(self, num_tokens: int) -> int:
        """Work tiles of any prefill batch of at most num_tokens tokens and max_reqs requests."""
        return triton.cdiv(num_tokens, self.extend_blocks[0]) + self._prefill_reqs

    def init_prefill_graph(self, max_tokens: int, max_reqs: int) -> None:
        """One fixed metadata buffer for every captured prefill size: q_start, prefix and extend lengths
        of max_reqs requests, then the work list (tile_req, tile_m) of the largest size."""
        self._prefill_reqs = -(-max_reqs // 4) * 4  # keeps every part 16-byte aligned
        tiles = -(-self._max_tiles(max_tokens) // 4) * 4
        self._prefill_layout = (self._prefill_reqs, tiles)
        self._prefill_meta = torch.zeros(3 * self._prefill_reqs + 2 * tiles, dtype=torch.int32,
                                         device=self.config.device)
        self._prefill_meta[3 * self._prefill_reqs:3 * self._prefill_reqs + tiles] = -1  # capture: no work

    def prepare_prefill_capture(self, batch: Batch, num_tokens: int) -> None:
        """Metadata of a prefill graph of num_tokens tokens: views of the fixed buffer (the work list
        sized for the most tiles such a batch can have) and the runner's fixed table_idx."""
        r, tiles = self._prefill_layout
        buf = self._prefill_meta
        n = self._max_tiles(num_tokens)
        batch.attn_metadata = TritonExtendMetadata(batch.table_idx, buf[:r], buf[r:2 * r], buf[2 * r:3 * r],
                                                   buf[3 * r:3 * r + n], buf[3 * r + tiles:3 * r + tiles + n], n)

    def prepare_prefill_replay(self, batch: Batch) -> None:
        """Write this batch's metadata into the fixed buffer (one copy): padding requests have no new
        tokens and padding tiles request -1, so the captured launch skips them."""
        r, tiles = self._prefill_layout
        assert batch.size <= r
        starts, prefix, extend, tile_req, tile_m = self._extend_parts(batch)
        host, slot = self._staging.take(self._prefill_meta.numel())
        flat = host[: self._prefill_meta.numel()].numpy()
        flat[:] = 0
        for i, part in enumerate((starts, prefix, extend)):
            flat[i * r:i * r + len(part)] = part
        flat[3 * r:3 * r + tiles] = -1
        flat[3 * r:3 * r + len(tile_req)] = tile_req
        flat[3 * r + tiles:3 * r + tiles + len(tile_m)] = tile_m
        self._prefill_meta.copy_(host[: self._prefill_meta.numel()], non_blocking=True)
        self._staging.used(slot)
