"""The CPU backend: the torch backend, with decode through the C kernel of kernel/cpu/, which reads
each request's K/V rows through the page table where they lie instead of gathering them into a padded
copy first (docs/BENCHMARKS.md has the time per layer). The KV pool is float32 (`kv_cache_dtype`); a
bf16/fp16 model stores its K/V there exactly and attends with its query upcast, the output rounded to the
model's dtype once. `auto` picks it on CPUs where the kernel builds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minisgl import kernel
from minisgl.kernel import cpu as cpu_kernels

from .torch_backend import TorchAttnBackend

if TYPE_CHECKING:
    from minisgl.core import Batch


@dataclass
class CpuDecodeMetadata:
    rows: torch.Tensor  # [B] int64 page-table row of each request
    lens: torch.Tensor  # [B] int64 keys to attend (cached tokens + the new one)


class CpuAttnBackend(TorchAttnBackend):
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
        if not batch.is_decode:
            return super().prepare_metadata(batch)
        batch.attn_metadata = CpuDecodeMetadata(
            batch.table_idx.to(torch.int64), batch.seq_lens_t.to(torch.int64)
        )

    def forward(self, q, k, v, layer_id, batch, rope=None):
        assert rope is None, "this backend does not fuse rotary (its fusion plan is UNFUSED)"
        if not batch.is_decode:
            return super().forward(q, k, v, layer_id, batch)
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
