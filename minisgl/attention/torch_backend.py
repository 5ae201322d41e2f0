"""The reference attention backend in plain PyTorch: runs on any device, any page size.

Decode gathers every request's K/V through the page table into one padded tensor and runs one masked
SDPA for the whole batch; prefill/extend runs one SDPA per request (a query at position p sees keys
0..p, prefix included; on a layer with a sliding window w, keys p-w+1..p)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from minisgl import kernel

from .base import BaseAttnBackend

if TYPE_CHECKING:
    from minisgl.core import Batch


@dataclass
class TorchAttnMetadata:
    # decode: [B, L] slot of every key position (padded); per window (0: full) the [B, 1, 1, L] mask of the
    # keys each request's query sees
    kv_indices: torch.Tensor
    kv_masks: dict[int, torch.Tensor] | None
    # prefill: per request (query start, query length, key length, per window its mask or None: causal)
    segments: list[tuple] | None = None


def _extend_mask(prefix: int, total: int, window: int, device: torch.device) -> torch.Tensor | None:
    """Which of keys 0..total-1 the queries at positions prefix..total-1 see; None where that is SDPA's
    causal mask (no prefix, and the window, if any, covers every key)."""
    if prefix == 0 and (not window or total <= window):
        return None
    q_pos = torch.arange(prefix, total, device=device)[:, None]
    keys = torch.arange(total, device=device)[None, :]
    mask = keys <= q_pos
    if window and total > window:
        mask &= keys > q_pos - window
    return mask


class TorchAttnBackend(BaseAttnBackend):
    sliding_window = True
    supports_fp8_kv = True  # stores with a cast, upcasts what it reads

    def prepare_metadata(self, batch: Batch) -> None:
        seq_lens = batch.seq_lens
        max_len = max(seq_lens)
        rows = self.page_table[batch.table_idx, :max_len]  # [B, L]
        windows = set(self.config.windows) | {0}
        if batch.is_decode:
            lens = batch.seq_lens_t.to(rows.device)[:, None]
            pos = torch.arange(max_len, device=rows.device)[None, :]
            masks = {}
            for w in windows:
                mask = pos < lens
                if w and max_len > w:
                    mask &= pos >= lens - w
                masks[w] = mask[:, None, None, :]
            batch.attn_metadata = TorchAttnMetadata(rows, masks)
            return
        segments, start = [], 0
        for i, (prefix, extend) in enumerate(zip(batch.prefix_lens, batch.extend_lens)):
            total = prefix + extend
            masks = {w: _extend_mask(prefix, total, w, rows.device) for w in windows}
            segments.append((start, extend, total, masks))
            start += extend
        batch.attn_metadata = TorchAttnMetadata(rows, None, segments)

    def forward(self, q, k, v, layer_id, batch, rope=None):
        assert rope is None, "this backend does not fuse rotary (its fusion plan is UNFUSED)"
        k_cache, v_cache = self.kv_pool.k(layer_id), self.kv_pool.v(layer_id)
        if k is not None:
            kernel.store_kv(k_cache, v_cache, batch.out_loc, k, v)
        meta: TorchAttnMetadata = batch.attn_metadata
        gqa = q.shape[1] != k_cache.shape[1]
        window = self.window(layer_id)
        if batch.is_decode:
            idx = meta.kv_indices.flatten()  # index_select is several times faster than k_cache[idx]
            shape = (*meta.kv_indices.shape, *k_cache.shape[1:])
            keys = k_cache.index_select(0, idx).view(shape).transpose(1, 2)  # [B, Hkv, L, D]
            values = v_cache.index_select(0, idx).view(shape).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2),
                keys.to(q.dtype),
                values.to(q.dtype),
                attn_mask=meta.kv_masks[window],
                scale=self.scale,
                enable_gqa=gqa,
            )
            return out.squeeze(2)
        out = torch.empty_like(q)
        for i, (start, extend, total, masks) in enumerate(meta.segments):
            # 4-D inputs: on a CPU, 3-D ones take SDPA's unfused math path (measured 2-5x slower)
            idx = meta.kv_indices[i, :total]
            keys = k_cache.index_select(0, idx).transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, Hkv, S, D]
            values = v_cache.index_select(0, idx).transpose(0, 1).unsqueeze(0).to(q.dtype)
            qi = q[start : start + extend].transpose(0, 1).unsqueeze(0)  # [1, Hq, E, D]
            mask = masks[window]
            o = F.scaled_dot_product_attention(
                qi, keys, values, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=gqa
            )
            out[start : start + extend] = o[0].transpose(0, 1)
        return out
