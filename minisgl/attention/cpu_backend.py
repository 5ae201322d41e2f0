"""The CPU backend: every step's attention through the C kernel of kernel/cpu/, which reads each request's
K/V rows through the page table where they lie instead of gathering them into a padded copy first
(docs/BENCHMARKS.md has the time per layer). A prefill's tokens are rows of one request, one more key each
(the kernel attends such rows together, each key read once for many of them): about twice as fast as the
torch backend's SDPA at 500 tokens. The KV pool is float32 (`kv_cache_dtype`); a
bf16/fp16 model stores its K/V there exactly and attends with its query upcast, the output rounded to the
model's dtype once. `auto` picks it on CPUs where the kernel builds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minisgl import kernel
from minisgl.kernel import cpu as cpu_kernels

from .base import BaseAttnBackend

if TYPE_CHECKING:
    from minisgl.core import Batch


@dataclass
class CpuDecodeMetadata:
    rows: torch.Tensor  # [T] int64 page-table row of each query token's request
    lens: torch.Tensor  # [T] int64 keys the token attends (its position + 1)


class CpuAttnBackend(BaseAttnBackend):
    sliding_window = True
    # the C decode kernel reads float32 K/V only (half-precision K/V are stored exactly, upcast)
    supports_fp8_kv = False
    kv_dtype = torch.float32

    def __init__(self, config, kv_pool, page_table) -> None:
        super().__init__(config, kv_pool, page_table)
        if (
            config.device.type != "cpu"
            or kv_pool.k_buffer.dtype != torch.float32
            or not cpu_kernels.available()
        ):
            raise ValueError(
                "the cpu attention backend needs a CPU, a float32 KV pool and a C compiler "
                "(use --attn torch otherwise)"
            )

    def prepare_metadata(self, batch: Batch) -> None:
        rows = batch.table_idx.to(torch.int64)
        if batch.is_decode:
            batch.attn_metadata = CpuDecodeMetadata(rows, batch.seq_lens_t.to(torch.int64))
            return
        assert batch.positions is not None
        extend = torch.tensor(batch.extend_lens, dtype=torch.int64)
        batch.attn_metadata = CpuDecodeMetadata(
            rows.repeat_interleave(extend), batch.positions.to(torch.int64) + 1
        )

    def forward(self, q, k, v, layer_id, batch, rope=None):
        assert rope is None, "this backend does not fuse rotary (its fusion plan is UNFUSED)"
        k_cache, v_cache = self.kv_pool.k(layer_id), self.kv_pool.v(layer_id)
        if k is not None:
            kernel.store_kv(k_cache, v_cache, batch.out_loc, k, v)
        meta: CpuDecodeMetadata = batch.attn_metadata
        out = cpu_kernels.decode_attention(
            q.float(),
            k_cache,
            v_cache,
            self.page_table,
            meta.rows,
            meta.lens,
            self.scale,
            self.window(layer_id),
        )
        return out.to(q.dtype)
