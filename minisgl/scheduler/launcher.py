"""Launcher: a step's compute put on the engine's stream, after what the current stream prepared.

The scheduler prepares step N on the current stream while the engine's stream may still compute step
N-1; the launch orders the two. It also counts the requests per step, and times a CPU prefill step the
pacer sized (a CPU step runs as it is called, so its launch time is the step's)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from minisgl.core import Batch
from minisgl.utils.device import create_stream, current_stream, use_stream

if TYPE_CHECKING:
    from minisgl.engine import Engine, ForwardOutput, Logits
    from minisgl.grammar import TokenMask

    from .pacing import PrefillPacer


class Launcher:
    def __init__(self, engine: Engine, pacer: PrefillPacer | None) -> None:
        self.engine, self.device, self.pacer = engine, engine.device, pacer
        self.stream = create_stream(self.device)  # the engine computes here
        self.paced = False  # the next batch is a prefill step the pacer sized: its time measures the pace
        self.last_batch_size = 0
        self.max_batch_size = 0

    def launch(self, batch: Batch) -> ForwardOutput:
        """The whole step: forward and sampling."""
        return self._on_engine_stream(batch, self.engine.forward_batch)

    def launch_forward(self, batch: Batch) -> Logits:
        """The forward alone, for a batch whose grammar masks wait for the step in flight."""
        return self._on_engine_stream(batch, self.engine.forward)

    def launch_sample(self, batch: Batch, fwd: Logits, mask: Callable[[Batch], TokenMask]) -> ForwardOutput:
        """Sample a batch launched with `launch_forward`, the matchers up to date: `mask(batch)` (its
        constrained rows' masks, filled on the engine's stream), then the engine."""
        with use_stream(self.stream):
            return self.engine.sample(batch, fwd, mask(batch))

    def _on_engine_stream(self, batch: Batch, run: Callable[[Batch], Any]) -> Any:
        size = batch.size if batch.drafts is None else batch.drafts.count(-1)  # requests, not rows
        self.last_batch_size = size
        self.max_batch_size = max(self.max_batch_size, size)
        self.stream.wait_stream(current_stream(self.device))
        paced, self.paced = self.paced, False
        start = time.perf_counter()
        with use_stream(self.stream):
            out = run(batch)
        if paced and self.pacer is not None:
            chunks = list(zip(batch.extend_lens, batch.prefix_lens))
            self.pacer.measured(time.perf_counter() - start, chunks)
        return out
