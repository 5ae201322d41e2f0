"""The per-process Context: what the layers read during a forward pass. The model's forward() takes no
arguments: the Engine sets the batch being computed here (`forward_batch`), with the KV pool and the
attention (and MoE) backend it built, and the layers read what they need (input ids, positions,
attention metadata) from it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minisgl.attention.base import BaseAttnBackend
    from minisgl.core import Batch
    from minisgl.kvcache.pool import KVPool


@dataclass
class Context:
    """Per-process state the layers read during a forward pass."""

    kv_pool: KVPool
    attn_backend: BaseAttnBackend
    moe_backend: Any = None  # a minisgl.moe.MoEBackend for an MoE model (moe sits above layers)
    batch: Batch | None = None

    @contextlib.contextmanager
    def forward_batch(self, batch: Batch) -> Iterator[Batch]:
        assert self.batch is None, "forward_batch is not re-entrant"
        self.batch = batch
        try:
            yield batch
        finally:
            self.batch = None


_GLOBAL_CTX: Context | None = None


def set_global_ctx(ctx: Context | None) -> None:
    global _GLOBAL_CTX
    _GLOBAL_CTX = ctx


def get_global_ctx() -> Context:
    assert _GLOBAL_CTX is not None, "the global Context is set by the Engine"
    return _GLOBAL_CTX
