"""The Triton attention backend, the default on CUDA: paged decode with split KV, and prefill/extend over a
cached prefix (kernels in kernel/triton/attention.py). This file plans them: split counts and tiles,
partial-result buffers, the extend work list, the fusion plan of each batch, and the fixed buffers of
decode and prefill CUDA graphs.

Decode splits each request's keys so the first stage fills the GPU several times over even at batch
size 1; with one split (large batches) it writes the output itself. Its fusion plan: the decode kernel
applies rotary (and Qwen3's q/k norm) to q and the new k and stores the new K/V, and with one request in
several splits the output projection merges them (kernel.SplitAttention). Prefill/extend reads every key
from the pool, so its plan lets the rotary kernel store the new K/V. Prefill CUDA graphs keep the metadata
and the work list in a fixed buffer (init_prefill_graph / prepare_prefill_capture / prepare_prefill_replay).

Also runs on CPU tensors under TRITON_INTERPRET=1 (the CPU tests), with smaller tiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import triton

from minisgl.env import ENV
from minisgl.kernel import DECODE_STEP_MAX_BATCH, Rope, SplitAttention, decode_step_available
from minisgl.kernel.triton import store_kv
from minisgl.kernel.triton.attention import decode_split, extend_attention, merge_splits
from minisgl.utils.device import HostRing

from .base import AttnConfig, BaseAttnBackend, FusionPlan

if TYPE_CHECKING:
    from minisgl.core import Batch
    from minisgl.kvcache.pool import KVPool

_WAVES = 8  # stage-1 programs per SM to aim for: many waves hide the tail of uneven splits
_MAX_SPLITS = 64  # beyond this, stage 2 costs more than the extra parallelism gains
_EXTEND_PLAN = FusionPlan(kv_store_in_rotary=True)  # the extend kernel reads every key from the pool


def parse_decode_tiles(value: str, defaults: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """MINISGL_DECODE_TILE: two tiles, for batches of several requests and for one request, each
    BLOCK_N:warps:stages in several splits:stages in one[:programs an SM the split count aims for, the
    default tile's where left out]."""
    try:
        tiles = tuple(tuple(int(x) for x in t.split(":")) for t in value.split(","))
        if len(tiles) == 2 and all(len(t) in (4, 5) and min(t) > 0 for t in tiles):
            return tuple(t + d[len(t) :] for t, d in zip(tiles, defaults))
    except ValueError:
        pass
    raise ValueError(
        f"MINISGL_DECODE_TILE={value!r}: expected two tiles BLOCK_N:warps:stages:stages[:programs an SM], "
        "for batches then for one request, positive integers, e.g. 32:1:3:3,64:4:3:4"
    )


# ---- the backend ---------------------------------------------------------------------------------------
@dataclass
class TritonDecodeMetadata:
    table_idx: torch.Tensor  # [B] page-table row of each request
    seq_lens: torch.Tensor  # [B] keys of each request, the new token included
    num_splits: int
    mid_o: torch.Tensor | None  # [B, Hq, num_splits, D] float32: each split's normalised partial output
    mid_lse: torch.Tensor | None  # [B, Hq, num_splits] float32: each split's log2-sum-exp (None: 1 split)
    plan: FusionPlan  # rotary and the KV store in the kernel; the merge in the O projection at 1 request
    # (BLOCK_N, warps, stages in several splits, stages in one, programs an SM the split count aims for):
    # the splits are whole blocks of BLOCK_N keys
    tile: tuple[int, ...]


@dataclass
class TritonExtendMetadata:
    table_idx: torch.Tensor  # [B]
    q_start: torch.Tensor  # [B] first row of each request's new tokens in q (cu_seqlens without the end)
    prefix_lens: torch.Tensor  # [B] cached tokens before the new ones
    extend_lens: torch.Tensor  # [B] new tokens
    tile_req: torch.Tensor  # [num_tiles] request of each work tile (-1: padding)
    tile_m: torch.Tensor  # [num_tiles] its query tile within the request
    num_tiles: int  # sizes the grid
    plan: FusionPlan = _EXTEND_PLAN


def extend_tiles(
    prefix_lens: np.ndarray, extend_lens: np.ndarray, block_m: int
) -> tuple[np.ndarray, np.ndarray]:
    """The extend kernel's work list: every (request, query tile) pair, those with the most keys first
    (the longest programs start in the first wave)."""
    counts = -(-extend_lens // block_m)
    req = np.repeat(np.arange(len(extend_lens)), counts)
    m = np.arange(len(req)) - np.repeat(np.cumsum(counts) - counts, counts)
    order = np.argsort(-(prefix_lens[req] + m * block_m), kind="stable")
    return req[order].astype(np.int32), m[order].astype(np.int32)


class TritonAttnBackend(BaseAttnBackend):
    """Split-KV paged decode and flash-attention extend in Triton; supports CUDA graphs for decode."""

    supports_fp8_kv = True  # the kernels store with a cast and upcast what they read

    def __init__(self, config: AttnConfig, kv_pool: KVPool, page_table: torch.Tensor) -> None:
        super().__init__(config, kv_pool, page_table)
        assert config.num_heads % config.num_kv_heads == 0
        on_gpu = config.device.type == "cuda"
        if on_gpu:
            self.num_sms = torch.cuda.get_device_properties(config.device).multi_processor_count
            # tilings chosen with python -m minisgl.benchmark.attn_decode / attn_extend, W1 and W2
            # (docs/BENCHMARKS.md). Decode of several requests: 32-key blocks, one warp a program (its 16-row
            # dot tiles need no cross-warp reductions); of one request: 64-key blocks, 4 warps. A float8
            # pool's programs read half the bytes: twice as many of them an SM (2 splits at batch 256), with a
            # two-stage key pipeline (W1 34,355 against 33,161 with three, run X3)
            if kv_pool.k_buffer.element_size() == 1:
                self.decode_tiles = ((32, 1, 2, 3, 2 * _WAVES), (64, 4, 3, 4, _WAVES))
            else:
                self.decode_tiles = ((32, 1, 3, 3, _WAVES), (64, 4, 3, 4, _WAVES))
            self.extend_blocks = (64, 64) if config.head_dim <= 128 else (64, 32)
            self.extend_launch = {"num_warps": 4, "num_stages": 2}
        else:  # TRITON_INTERPRET: small tiles, so short test sequences still cross several tiles and splits
            self.num_sms = 4
            self.decode_tiles = ((16, 4, 2, 2, _WAVES), (16, 4, 2, 2, _WAVES))
            self.extend_blocks = (16, 16)
            self.extend_launch = {"num_warps": 4, "num_stages": 2}
        if ENV.decode_tile:
            self.decode_tiles = parse_decode_tiles(ENV.decode_tile, self.decode_tiles)
        # opt-in: on an H200 the layer kernel measured slower than the layer's own kernels (docs/BENCHMARKS.md)
        self.layer_kernel = ENV.layer_kernel
        # the whole decode step of up to DECODE_STEP_MAX_BATCH requests as one CUDA launch where it builds
        # (kernel/step_kernel.py); not with a sliding window, whose keys the kernel does not cut. Under
        # MINISGL_DECODE_STEP=auto each size waits for the decode graph runner's timing (choose_whole_step)
        mode = ENV.decode_step  # read on every device, so a malformed value is refused anywhere
        step = (
            on_gpu
            and not config.windows
            and kv_pool.k_buffer.dtype == config.dtype
            and decode_step_available(config.device)
        )
        sizes = frozenset(range(1, DECODE_STEP_MAX_BATCH + 1)) if step else frozenset()
        self.step_sizes = sizes if mode == "on" else frozenset()  # batch sizes planned as the kernel
        self.whole_step_undecided = sizes if mode == "auto" else frozenset()
        # fp32 runs (the CPU-equality tests on a GPU) must not silently drop to TF32 inside tl.dot
        self.precision = "ieee" if config.dtype == torch.float32 else "tf32"
        self._staging = HostRing(config.device)  # pinned buffers for the extend metadata
        self._graph_splits: dict[int, int] = {}
        self._graph_mid_o: torch.Tensor | None = None
        self._graph_mid_lse: torch.Tensor | None = None

    def decode_tile(self, batch_size: int) -> tuple[int, ...]:
        """Decode's (BLOCK_N, warps, stages in several splits, stages in one, programs an SM the split
        count aims for) at batch_size requests."""
        return self.decode_tiles[batch_size == 1]

    # ---- metadata --------------------------------------------------------------------------------
    def num_splits(self, batch_size: int, max_seq_len: int) -> int:
        """Splits per (request, KV head): enough stage-1 programs for the tile's programs an SM, at most
        one split per key block, capped at _MAX_SPLITS."""
        programs = batch_size * self.config.num_kv_heads
        tile = self.decode_tile(batch_size)
        wanted = triton.cdiv(self.num_sms * tile[4], programs)
        blocks = triton.cdiv(max_seq_len, tile[0])
        return max(1, min(wanted, blocks, _MAX_SPLITS))

    def _decode_metadata(
        self, batch: Batch, num_splits: int, mid_o: torch.Tensor | None, mid_lse: torch.Tensor | None
    ) -> TritonDecodeMetadata:
        # one request in several splits: the output projection's GEMV merges them as it reads them; one
        # request: the whole layer in one launch where the layer kernel serves (kernel/triton/layer.py)
        one = batch.size == 1
        plan = FusionPlan(
            rope_in_attention=True,
            merge_in_o_proj=one and num_splits > 1,
            whole_layer=one and self.layer_kernel,
            whole_step=batch.size in self.step_sizes,
        )
        if batch.drafts is not None:  # a verify step: rows of one request read each other's new K/V, so
            plan = _EXTEND_PLAN  # every row stores before any attends (not inside the attention kernel)
        tile = self.decode_tile(batch.size)
        return TritonDecodeMetadata(batch.table_idx, batch.seq_lens_t, num_splits, mid_o, mid_lse, plan, tile)

    def prepare_metadata(self, batch: Batch) -> None:
        cfg, device = self.config, self.config.device
        if batch.is_decode:
            bs = batch.size
            splits = self.num_splits(bs, max(batch.seq_lens))  # host list: no device sync
            mid_o = mid_lse = None  # one split writes the output directly
            if splits > 1:
                mid_o = torch.empty(
                    (bs, cfg.num_heads, splits, cfg.head_dim), dtype=torch.float32, device=device
                )
                mid_lse = torch.empty((bs, cfg.num_heads, splits), dtype=torch.float32, device=device)
            batch.attn_metadata = self._decode_metadata(batch, splits, mid_o, mid_lse)
            return
        parts = self._extend_parts(batch)
        # each part 16-byte aligned (Triton specialises on pointer alignment: no recompiles per batch size)
        dev, offsets = self._staging.pack(parts)
        q_start, prefix_lens, extend_lens, tile_req, tile_m = (
            dev[off : off + len(p)] for off, p in zip(offsets, parts)
        )
        batch.attn_metadata = TritonExtendMetadata(
            batch.table_idx, q_start, prefix_lens, extend_lens, tile_req, tile_m, len(parts[3])
        )

    def _extend_parts(self, batch: Batch) -> list[np.ndarray]:
        """q_start, prefix_lens, extend_lens (per request), tile_req, tile_m (per work tile), on the host."""
        prefix = np.asarray(batch.prefix_lens, dtype=np.int32)
        extend = np.asarray(batch.extend_lens, dtype=np.int32)
        starts = (np.cumsum(extend) - extend).astype(np.int32)
        return [starts, prefix, extend, *extend_tiles(prefix, extend, self.extend_blocks[0])]

    # ---- compute ---------------------------------------------------------------------------------
    def fusion_plan(self, batch: Batch) -> FusionPlan:
        return batch.attn_metadata.plan

    def layer_inputs(self, batch: Batch, layer_id: int) -> dict:
        meta = batch.attn_metadata
        mid_o, mid_lse, splits = meta.mid_o, meta.mid_lse, meta.num_splits
        if mid_o is None:  # one split: the layer kernel still takes its output through the merge
            cfg = self.config
            mid_o = torch.empty((1, cfg.num_heads, 1, cfg.head_dim), dtype=torch.float32, device=cfg.device)
            mid_lse = torch.empty((1, cfg.num_heads, 1), dtype=torch.float32, device=cfg.device)
        return {
            "k_cache": self.kv_pool.k(layer_id),
            "v_cache": self.kv_pool.v(layer_id),
            "page_table": self.page_table,
            "table_idx": meta.table_idx,
            "seq_lens": meta.seq_lens,
            "out_loc": batch.out_loc,
            "positions": batch.positions,
            "mid_o": mid_o,
            "mid_lse": mid_lse,
            "num_splits": splits,
            "scale": self.scale,
            "block_n": meta.tile[0],
            "precision": self.precision,
        }

    def choose_whole_step(self, size: int, on: bool) -> None:
        self.step_sizes = self.step_sizes | {size} if on else self.step_sizes - {size}
        self.whole_step_undecided = self.whole_step_undecided - {size}

    def step_inputs(self, batch: Batch) -> dict:
        meta = batch.attn_metadata
        return {
            "k_buffer": self.kv_pool.k_buffer,
            "v_buffer": self.kv_pool.v_buffer,
            "page_table": self.page_table,
            "table_idx": meta.table_idx,
            "seq_lens": meta.seq_lens,
            "out_loc": batch.out_loc,
            "positions": batch.positions,
            "scale": self.scale,
        }

    def forward(self, q, k, v, layer_id, batch, rope: Rope | None = None) -> torch.Tensor | SplitAttention:
        k_cache, v_cache = self.kv_pool.k(layer_id), self.kv_pool.v(layer_id)
        meta = batch.attn_metadata
        if rope is not None:
            assert batch.is_decode and k is not None
            return self._decode(q, k_cache, v_cache, meta, (rope, k, v, batch.out_loc))
        if k is not None:
            store_kv(k_cache, v_cache, batch.out_loc, k, v)
        if batch.is_decode:
            return self._decode(q, k_cache, v_cache, meta)
        return extend_attention(
            q,
            k_cache,
            v_cache,
            self.page_table,
            meta.table_idx,
            meta.q_start,
            meta.prefix_lens,
            meta.extend_lens,
            meta.tile_req,
            meta.tile_m,
            meta.num_tiles,
            self.scale,
            blocks=self.extend_blocks,
            precision=self.precision,
            **self.extend_launch,
        )

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TritonDecodeMetadata,
        new_kv: tuple | None = None,
    ) -> torch.Tensor | SplitAttention:
        """new_kv = (rope, k, v, out_loc): q, k, v are unrotated and the kernel rotates them and stores k/v.
        Under the plan's merge_in_o_proj the splits come back unmerged (SplitAttention)."""
        bs = q.shape[0]
        mid_o, mid_lse, splits = meta.mid_o, meta.mid_lse, meta.num_splits
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        direct = splits == 1  # one split: stage 1 writes the output, no merge
        block_n, num_warps, several, one, _ = meta.tile
        decode_split(
            q,
            k_cache,
            v_cache,
            self.page_table,
            meta.table_idx,
            meta.seq_lens,
            out[:, :, None, :] if direct else mid_o,
            None if direct else mid_lse,
            splits,
            self.scale,
            block_n=block_n,
            precision=self.precision,
            num_warps=num_warps,
            num_stages=one if direct else several,
            new_kv=new_kv,
        )
        if direct:
            return out
        if meta.plan.merge_in_o_proj:
            return SplitAttention(
                mid_o,
                mid_lse,
                meta.seq_lens,
                splits,
                block_n,
                q.dtype,
                lambda: merge_splits(mid_o, mid_lse, meta.seq_lens, splits, out, block_n).view(bs, -1),
            )
        return merge_splits(mid_o, mid_lse, meta.seq_lens, splits, out, block_n)

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
        self._prefill_meta = torch.zeros(
            3 * self._prefill_reqs + 2 * tiles, dtype=torch.int32, device=self.config.device
        )
        self._prefill_meta[3 * self._prefill_reqs : 3 * self._prefill_reqs + tiles] = -1  # capture: no work

    def prepare_prefill_capture(self, batch: Batch, num_tokens: int) -> None:
        """Metadata of a prefill graph of num_tokens tokens: views of the fixed buffer (the work list
        sized for the most tiles such a batch can have) and the runner's fixed table_idx."""
        r, tiles = self._prefill_layout
        buf = self._prefill_meta
        n = self._max_tiles(num_tokens)
        batch.attn_metadata = TritonExtendMetadata(
            batch.table_idx,
            buf[:r],
            buf[r : 2 * r],
            buf[2 * r : 3 * r],
            buf[3 * r : 3 * r + n],
            buf[3 * r + tiles : 3 * r + tiles + n],
            n,
        )

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
            flat[i * r : i * r + len(part)] = part
        flat[3 * r : 3 * r + tiles] = -1
        flat[3 * r : 3 * r + len(tile_req)] = tile_req
        flat[3 * r + tiles : 3 * r + tiles + len(tile_m)] = tile_m
        self._prefill_meta.copy_(host[: self._prefill_meta.numel()], non_blocking=True)
        self._staging.used(slot)
