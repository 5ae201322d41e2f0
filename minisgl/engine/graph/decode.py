"""Decode graphs: one per batch size, the whole step but sampling, and a small sampling graph per size for
the batches that sample (`DecodeGraphRunner`)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import NamedTuple

import torch

from minisgl import kernel
from minisgl.core import Batch, Phase
from minisgl.utils import init_logger
from minisgl.utils.device import is_cuda

from ..sampler import SamplingInfo, draw_step_seed
from .base import (
    BaseGraphRunner,
    EmulatedGraph,
    GraphDeps,
    InputRows,
    capture_cuda,
    capture_emulated,
    padding,
)
from .sizes import DEFAULT_MAX_BS, capture_sizes

logger = init_logger(__name__)

# A decode step's graph inputs, [4, batch]: the scheduler packs them in this order next to each other
# (Batch.graph_inputs), so a replay copies them into the graph's fixed buffer with one copy.
DECODE_INPUTS = InputRows(("positions", "out_loc", "table_idx", "seq_lens_t"))

# the context at which a step of 1-8 requests is timed both ways (MINISGL_DECODE_STEP=auto): W2's order of
# magnitude; the one-kernel step's attention splits each KV head's keys at most 16 ways, so its lead
# shrinks with the context
TIMING_CONTEXT = 1024


class DecodeOutput(NamedTuple):
    """A decode graph's fixed outputs, [padded size, ...], rows in batch order."""

    hidden: torch.Tensor  # the final hidden states
    logits: torch.Tensor
    tokens: torch.Tensor  # int32 argmax of the logits, already written into the token pool


class SampleOutput(NamedTuple):
    """A sampling graph's fixed output."""

    tokens: torch.Tensor  # [padded size] int32 sampled tokens, already written into the token pool


class DecodeGraphRunner(BaseGraphRunner[DecodeOutput]):
    """Decode at a list of batch sizes. A graph holds the whole step but sampling: the page-table entries
    of the new tokens, reading the input tokens from the token pool, the model, the LM head, the greedy
    token (argmax) and writing it into the token pool. A batch that samples replaces the greedy tokens
    afterwards from the graph's logits: in the size's sampling graph (capture_sampling) when the engine
    gives a `sample` op, else (and for penalised batches) eagerly. The inputs are one [4, batch] block
    (DECODE_INPUTS), one copy.

    A padding row is a complete one-token request at position 0 of the dummy row, sequence length 1, so
    it attends to exactly the key it wrote into the dummy slot."""

    label = "decode graphs"

    def __init__(self, deps: GraphDeps, sizes: list[int], backend_hooks: bool) -> None:
        super().__init__(deps, sizes)
        self.max_bs = sizes[-1]
        self.backend_hooks = backend_hooks  # False: CPU emulation recomputing metadata (torch backend)
        pad = DECODE_INPUTS.ordered(
            positions=0, out_loc=deps.dummy_slot, table_idx=deps.dummy_row, seq_lens_t=1
        )
        self._pad = padding(pad, self.max_bs, deps.device)
        self._inputs = self._pad.clone()  # the fixed buffers, one row per field of DECODE_INPUTS
        # a sampling graph's fixed inputs: SamplingInfo.packed (all zeros: greedy rows) and the step seed
        self._sample_f = torch.zeros(3, self.max_bs, dtype=torch.float32, device=deps.device)
        self._sample_i = torch.zeros(3, self.max_bs, dtype=torch.int64, device=deps.device)
        self._step_seed = torch.zeros(1, dtype=torch.int64, device=deps.device)
        # keyed by (size, whether a row sets top-k, whether a row sets top-p): a batch without them skips
        # those searches' launches
        self.sample_graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph | EmulatedGraph] = {}
        self.sample_outputs: dict[tuple[int, bool, bool], SampleOutput] = {}
        self.sample_replays = 0  # sampled steps served by a sampling graph
        # sizes timed both ways at capture (MINISGL_DECODE_STEP=auto): {size: {one-kernel step?: ms a replay}}
        self.whole_step_ms: dict[int, dict[bool, float]] = {}

    @classmethod
    def create(cls, deps: GraphDeps, max_bs: int | None, max_running_req: int) -> DecodeGraphRunner | None:
        """A runner with every size captured, or None: graphs disabled (max_bs 0), a CPU without an
        explicit max_bs > 0, or a CUDA attention backend without graph hooks."""
        cuda = is_cuda(deps.device)
        if max_bs == 0 or (max_bs is None and not cuda):
            return None
        max_bs = min(max_bs or DEFAULT_MAX_BS, max_running_req)
        sizes = capture_sizes(max_bs)
        try:
            deps.attn_backend.init_capture_graph(max_bs, sizes)
            hooks = True
        except NotImplementedError:
            if cuda:
                name = type(deps.attn_backend).__name__
                logger.warning(f"{name} cannot be captured: CUDA graphs disabled")
                return None
            hooks = False  # CPU emulation can recompute the metadata from the buffers at replay
        runner = cls(deps, sizes, hooks)
        runner.capture_all()
        if deps.sample is not None:
            runner.capture_sampling()
        return runner

    def _capture_one(self, size: int) -> None:
        """As every size, except one where the attention backend has not chosen how its step runs
        (MINISGL_DECODE_STEP=auto): capture it both ways, time the two graphs with every request at
        TIMING_CONTEXT keys, keep the faster."""
        backend = self.deps.attn_backend
        if self.emulate or size not in backend.whole_step_undecided:
            super()._capture_one(size)
            return
        captured = {}
        for on in (False, True):
            backend.choose_whole_step(size, on)
            calls = kernel.decode_step_calls()
            try:
                super()._capture_one(size)
            except RuntimeError as e:  # the kernel's launch refused (decode_step says why): keep the layers
                if not on:
                    raise
                logger.warning(
                    f"The one-kernel decode step failed at batch {size}, the layers' own kernels run "
                    f"instead: {e}"
                )
                backend.choose_whole_step(size, False)
                self.graphs[size], self.outputs[size] = captured[False]
                return
            captured[on] = (self.graphs[size], self.outputs[size])
        if kernel.decode_step_calls() == calls:  # the kernel does not serve this model or size: no timing
            backend.choose_whole_step(size, False)
            self.graphs[size], self.outputs[size] = captured[False]
            return
        with self._timing_rows(backend, size) as keys:
            ms = _fastest_replay_ms({on: graph for on, (graph, _) in captured.items()})
        on = ms[True] < ms[False]
        backend.choose_whole_step(size, on)
        self.graphs[size], self.outputs[size] = captured[on]
        self.whole_step_ms[size] = ms
        logger.info(
            f"A decode step of {size} request(s): the one-kernel step {ms[True]:.3f} ms, the layers' own "
            f"kernels {ms[False]:.3f} ms a graph replay at {keys} keys each: keeping the "
            + ("one-kernel step" if on else "layers' own kernels")
            + " (MINISGL_DECODE_STEP=1 or 0 decides instead)"
        )

    @contextmanager
    def _timing_rows(self, backend, size: int):
        """The graphs' first `size` input rows as requests at TIMING_CONTEXT keys instead of the padding
        row's one: the dummy page-table row mapped to that many distinct slots (whatever they hold; the new
        K/V still goes to the dummy slot), so the timing reads what a step at that context reads. Restored
        after."""
        table = backend.page_table
        n = min(TIMING_CONTEXT, table.shape[1] - 1, backend.kv_pool.num_slots - 1)  # its token at position n
        row = self.dummy_row
        table[row, : n - 1] = torch.arange(n - 1, dtype=table.dtype, device=table.device)
        self._inputs[:, :size] = torch.tensor(
            DECODE_INPUTS.ordered(positions=n - 1, out_loc=self.dummy_slot, table_idx=row, seq_lens_t=n),
            dtype=self._inputs.dtype,
        ).to(self._inputs.device)[:, None]
        try:
            yield n
        finally:
            torch.cuda.synchronize(self.deps.device)
            table[row].fill_(self.dummy_slot)
            self._inputs.copy_(self._pad)

    def can_run(self, batch: Batch) -> bool:
        # a verify step is VerifyGraphRunner's: its rows of one request must store their K/V before any
        # attends, which the captured decode kernels (rotary and the store inside attention) do not do
        return batch.is_decode and batch.size <= self.max_bs and batch.drafts is None

    def _size_of(self, batch: Batch) -> int:
        return batch.size

    def _describe(self) -> str:
        return f"batch sizes {self.sizes[0]}..{self.max_bs}"

    def _buffer_batch(self, bs: int) -> Batch:
        """A decode batch of size bs whose tensors are views of the fixed buffers."""
        batch = Batch([None] * bs, Phase.DECODE, [0] * bs, [1] * bs, [True] * bs)  # reqs: only the count
        DECODE_INPUTS.assign(batch, (row[:bs] for row in self._inputs.unbind(0)))
        batch.padded_size = bs
        return batch

    def _forward(self, batch: Batch) -> DecodeOutput:
        deps = self.deps
        deps.prepare_inputs(batch)
        if not self.backend_hooks:
            # A backend without graph hooks (torch, CPU only) plans from host lengths: take them from the
            # fixed buffer, never from the batch being replayed.
            batch.prefix_lens = [n - 1 for n in batch.seq_lens_t.tolist()]
            deps.attn_backend.prepare_metadata(batch)
        hidden = deps.run_model(batch)
        logits = deps.compute_logits(hidden)
        tokens = kernel.argmax(logits)
        deps.token_pool[batch.table_idx, batch.positions + 1] = tokens
        return DecodeOutput(hidden, logits, tokens)

    def _prepare_capture(self, batch: Batch, size: int) -> None:
        if self.backend_hooks:
            self.deps.attn_backend.prepare_for_capture(batch)

    def _copy_in(self, batch: Batch, bs: int) -> None:
        n = batch.size
        batch.padded_size = bs
        inputs = batch.graph_inputs  # the scheduler packs them; a batch built by hand gets them stacked
        if inputs is None:
            inputs = torch.stack(DECODE_INPUTS.of(batch))
        self._inputs[:, :n].copy_(inputs, non_blocking=True)
        if bs > n:  # rows a larger batch left behind would write K/V into slots they no longer own
            self._inputs[:, n:bs].copy_(self._pad[:, n:bs], non_blocking=True)

    def _prepare_replay(self, batch: Batch) -> None:
        if self.backend_hooks:
            self.deps.attn_backend.prepare_for_replay(batch)

    def _result(self, batch: Batch, out: DecodeOutput) -> DecodeOutput:
        return out  # the first batch.size rows are the batch's

    # ---- sampling graphs: one per size, replayed right after the decode graph of a batch that samples --
    @torch.inference_mode()
    def capture_sampling(self) -> None:
        """Capture, per size, deps.sample on that size's fixed logits and the sampling buffers, writing the
        tokens into the token pool over the decode graph's greedy ones (a second, small graph: the decode
        graphs, and with them a greedy step, stay exactly as they are)."""
        start = time.perf_counter()
        for bs in sorted(self.sizes, reverse=True):
            for key in [(bs, k, p) for k in (False, True) for p in (False, True)]:
                self._capture_sampling(key)
        n = len(self.sample_graphs)
        logger.info(f"Captured {n} sampling graphs in {time.perf_counter() - start:.1f}s")

    def _capture_sampling(self, key: tuple[int, bool, bool]) -> None:
        bs, has_top_k, has_top_p = key
        batch = self._buffer_batch(bs)
        logits = self.outputs[bs].logits
        f, i = self._sample_f[:, :bs].unbind(0), self._sample_i[:, :bs].unbind(0)
        rows = kernel.SamplingRows(*f, *i, self._step_seed, has_top_k, has_top_p)

        def forward() -> SampleOutput:
            tokens = self.deps.sample(logits, rows)
            self.deps.token_pool[batch.table_idx, batch.positions + 1] = tokens
            return SampleOutput(tokens)

        if self.emulate:
            self.sample_graphs[key], self.sample_outputs[key] = capture_emulated(forward)
        else:
            self.sample_graphs[key], self.sample_outputs[key] = capture_cuda(
                forward, self._pool, self._stream, self.deps.device
            )

    def can_sample(self, info: SamplingInfo) -> bool:
        """Whether a batch this runner replayed samples in its sampling graph: it samples, and sets no
        penalty (those take the eager path)."""
        return bool(self.sample_graphs) and info.rows is not None and info.penalties is None

    def replay_sampling(self, batch: Batch, info: SamplingInfo) -> torch.Tensor:
        """After replay(batch): copy the batch's sampling rows (SamplingInfo.packed) and a fresh step seed
        into the fixed buffers, greedy padding rows after them, and replay the size's sampling graph.
        Returns the batch's tokens [batch.size] int32."""
        n, bs = batch.size, self.padded_size(batch.size)
        floats, ints = info.packed
        self._sample_f[:, :n].copy_(floats, non_blocking=True)
        self._sample_i[:, :n].copy_(ints, non_blocking=True)
        if bs > n:  # rows a larger batch left behind would sample (all zeros: greedy, the cheap path)
            self._sample_f[:, n:bs].zero_()
            self._sample_i[:, n:bs].zero_()
        self._step_seed.copy_(draw_step_seed(self.deps.device), non_blocking=True)
        key = (bs, info.rows.has_top_k, info.rows.has_top_p)
        self.sample_graphs[key].replay()
        self.sample_replays += 1
        return self.sample_outputs[key].tokens[:n]


def _fastest_replay_ms(graphs: dict, rounds: int = 5, replays: int = 10) -> dict:
    """Per graph, the fastest of `rounds` timings of `replays` back-to-back replays, in ms a replay; the
    graphs take turns, so a drift of the clocks meets each alike."""
    best = dict.fromkeys(graphs, float("inf"))
    for graph in graphs.values():  # a first replay loads whatever was not loaded yet
        graph.replay()
    for _ in range(rounds):
        for key, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            best[key] = min(best[key], start.elapsed_time(end) / replays)
    return best
