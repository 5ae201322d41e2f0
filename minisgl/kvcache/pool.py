"""The paged KV pool: per layer, K and V of shape [num_pages * page_size, kv_heads, head_dim].

A KV slot is one token's row; page p holds slots p*page_size .. p*page_size + page_size - 1. Which slots
are free is the scheduler's business (scheduler/cache.py); the pool only holds the memory."""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_slots = num_pages * page_size
        shape = (num_layers, self.num_slots, num_kv_heads, head_dim)
        # A slot is written before any step reads it, so the pool needs no zeros. On a CPU, zeroing touches
        # every page of a pool of GiBs at start (seconds of page faults); a fresh allocation's untouched pages
        # cost nothing until used. A GPU zeroes its pool in milliseconds, and graph-padded rows read slots.
        alloc = torch.empty if torch.device(device).type == "cpu" else torch.zeros
        self.k_buffer = alloc(shape, dtype=dtype, device=device)
        self.v_buffer = alloc(shape, dtype=dtype, device=device)

    def k(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def v(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )
