"""Verify graphs: a speculative verify step (scheduler/speculative.py) replays a graph as a decode step does.

A verify step is a decode-shaped batch of rows, k + 1 of them for a request with k proposals, so its graphs
are decode graphs captured at row counts (`VerifyGraphRunner`), padded with the decode graphs' padding rows,
with two differences. The attention plan stores every row's K/V before any row attends (rows of one
request read each other's new K/V; a decode graph stores inside the attention kernel). And a fixed
[3, rows] block of (page-table row, position, token) puts the proposals into the token pool
(Batch.draft_writes) before the rows read their input tokens from it; a padding row writes token 0 at
position 0 of the dummy row, the input a padding row reads.

The row counts are the decode batch sizes up to the first that holds the most rows a verify step has, so
the attention backend's fixed buffers, set up for the decode graphs, serve them too; the graphs share the
decode graphs' memory pool and capture stream (an engine replays one graph at a time, on one stream).
"""

from __future__ import annotations

import bisect

from minisgl.core import Batch

from .base import padding
from .decode import DecodeGraphRunner


class VerifyGraphRunner(DecodeGraphRunner):
    """Verify steps at row counts: a decode graph runner whose batches carry proposals (`Batch.drafts`)."""

    label = "verify graphs"

    def __init__(self, decode: DecodeGraphRunner, sizes: list[int]) -> None:
        super().__init__(decode.deps, sizes, decode.backend_hooks)
        self._pool, self._stream = decode._pool, decode._stream
        deps = decode.deps
        self._writes_pad = padding([deps.dummy_row, 0, 0], self.max_bs, deps.device)
        self._writes = self._writes_pad.clone()  # the fixed (rows, positions, ids) of the proposals

    @classmethod
    def create(cls, decode: DecodeGraphRunner | None, max_rows: int) -> VerifyGraphRunner | None:
        """A runner for verify steps of up to `max_rows` rows (fewer where the decode graphs stop), every
        size captured, with sampling graphs where the decode runner has them; None without decode graphs."""
        if decode is None:
            return None
        sizes = decode.sizes[: bisect.bisect_left(decode.sizes, max_rows) + 1]
        runner = cls(decode, sizes)
        runner.capture_all()
        if decode.sample_graphs:
            runner.capture_sampling()
        return runner

    def can_run(self, batch: Batch) -> bool:
        return batch.is_decode and batch.drafts is not None and batch.size <= self.max_bs

    def _describe(self) -> str:
        return f"rows {self.sizes[0]}..{self.max_bs}"

    def _buffer_batch(self, rows: int) -> Batch:
        batch = super()._buffer_batch(rows)
        batch.drafts = [-1] * rows  # a verify step: the backend plans the store before the attention
        batch.draft_writes = tuple(row[:rows] for row in self._writes.unbind(0))
        return batch

    def _copy_in(self, batch: Batch, rows: int) -> None:
        super()._copy_in(batch, rows)
        assert batch.draft_writes is not None, "a verify step brings its proposals' token-pool writes"
        n = batch.size
        for row, src in zip(self._writes, batch.draft_writes):
            row[:n].copy_(src, non_blocking=True)
        if rows > n:  # stale rows would write proposals of an earlier step into a live request's row
            self._writes[:, n:rows].copy_(self._writes_pad[:, n:rows], non_blocking=True)
