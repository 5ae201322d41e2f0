"""CUDA graphs: capture a forward once per size, replay it every step (decode and prefill).

Decode at small batch sizes is launch-bound, so replaying one graph instead of launching hundreds of kernels
matters more than any kernel; a large prefill step's host launch cost can exceed its GPU time too. A graph
replays fixed device addresses, so every input of a step is copied into fixed buffers first, and a batch is
padded to the nearest captured size. `BaseGraphRunner` holds what both runners share (capture into one
memory pool, largest size first; replay of the smallest graph that holds a batch); `DecodeGraphRunner` and
`PrefillGraphRunner` say what differs: their sizes, buffers, how a batch is copied in and what comes out.
A runner gets from the engine only `GraphDeps`: the device, the forward pieces, the token pool and the
dummy page-table row and KV slot.

Padding rows and tokens touch nothing real: they read page-table row `dummy_row` (the engine's extra row,
which maps position 0 to the dummy slot) and write their K/V into `dummy_slot`, the first slot of the one
page the engine allocates beyond `num_pages` (the scheduler never hands it out).

On a CPU (when asked for with `cuda_graph_max_bs > 0`) an EmulatedGraph stands in: its "capture" records
a closure that reads only the fixed buffers, so an input that replay forgets to copy gives a wrong result
on a CPU too, and the tests catch it.
"""

from __future__ import annotations

import bisect
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

import torch
from tqdm import tqdm

from minisgl import kernel
from minisgl.core import Batch, Phase
from minisgl.utils import init_logger
from minisgl.utils.device import is_cuda

from .sampler import SamplingInfo, draw_step_seed

if TYPE_CHECKING:
    from minisgl.attention.base import BaseAttnBackend

logger = init_logger(__name__)

DEFAULT_MAX_BS = 256  # on a GPU when --cuda-graph-max-bs is not given
DEFAULT_MAX_PREFILL = 8192  # tokens, on a GPU when --cuda-graph-max-prefill is not given
MAX_PREFILL_REQS = 64  # requests a captured prefill batch holds at most


@dataclass(frozen=True)
class InputRows:
    """The rows of a fixed int32 input block, each named after the Batch field (a 1-D tensor) it holds."""

    fields: tuple[str, ...]

    def ordered(self, **rows):
        """The given rows (one per field, by field name) in this layout's order."""
        assert rows.keys() == set(self.fields), f"expected the rows {self.fields}, got {tuple(rows)}"
        return [rows[f] for f in self.fields]

    def of(self, batch: Batch) -> list[torch.Tensor]:
        """The batch's tensors for these fields, in order."""
        return [getattr(batch, f) for f in self.fields]

    def assign(self, batch: Batch, rows: Iterable[torch.Tensor]) -> None:
        """Set the batch's fields to `rows`, in order."""
        rows = list(rows)
        assert len(rows) == len(self.fields)
        for f, row in zip(self.fields, rows):
            setattr(batch, f, row)


# A decode step's graph inputs, [4, batch]: the scheduler packs them in this order next to each other
# (Batch.graph_inputs), so a replay copies them into the graph's fixed buffer with one copy.
DECODE_INPUTS = InputRows(("positions", "out_loc", "table_idx", "seq_lens_t"))
# A prefill graph's fixed inputs: per token, and per request (the row to sample from may be shorter)
_PREFILL_TOKEN_INPUTS = InputRows(("input_ids", "positions", "out_loc"))
_PREFILL_REQ_INPUTS = InputRows(("table_idx", "logits_idx"))


@dataclass(frozen=True)
class GraphDeps:
    """What a graph runner needs from the engine, and nothing more."""

    device: torch.device
    attn_backend: BaseAttnBackend  # its graph hooks keep the attention metadata in fixed buffers
    prepare_inputs: Callable[[Batch], None]  # page-table writes (and a decode step's input ids)
    run_model: Callable[[Batch], torch.Tensor]  # final hidden states of a batch whose inputs are set
    compute_logits: Callable[[torch.Tensor], torch.Tensor]  # the LM head
    token_pool: torch.Tensor  # [rows, max_seq_len] int32: where a decode graph writes its greedy tokens
    dummy_row: int  # page-table row padding reads (the engine maps its position 0 to dummy_slot)
    dummy_slot: int  # KV slot padding writes
    show_progress: bool = False
    # kernel.sample, captured after each decode graph for the batches that sample; None: they sample eagerly
    sample: Callable[[torch.Tensor, kernel.SamplingRows], torch.Tensor] | None = None


class DecodeOutput(NamedTuple):
    """A decode graph's fixed outputs, [padded size, ...], rows in batch order."""

    hidden: torch.Tensor  # the final hidden states
    logits: torch.Tensor
    tokens: torch.Tensor  # int32 argmax of the logits, already written into the token pool


class SampleOutput(NamedTuple):
    """A sampling graph's fixed output."""

    tokens: torch.Tensor  # [padded size] int32 sampled tokens, already written into the token pool


class PrefillOutput(NamedTuple):
    """A prefill graph's fixed output."""

    logits: torch.Tensor  # [max_reqs, vocab]: the logits of the rows in logits_idx, in its order


def capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 128 and every 16 beyond, up to max_bs (always included): padding
    wastes at most 15 rows of a large batch, where the step time grows slowly with the batch size."""
    sizes = [1, 2, 4, 8] + list(range(16, 129, 8)) + list(range(144, max_bs + 1, 16))
    return sorted({s for s in sizes if s < max_bs} | {max_bs})


def prefill_sizes(max_tokens: int) -> list[int]:
    """Token counts captured for prefill: 16, 32, .., 1024, then every 1024 up to max_tokens (always
    included). Above 1024 tokens padding adds at most a third, where the step time is ~linear."""
    sizes = [16 << i for i in range(7)] + list(range(2048, max_tokens + 1, 1024))
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


class EmulatedGraph:
    """Stands in for torch.cuda.CUDAGraph on a CPU: replay() re-runs the closure recorded at capture,
    which reads only the graph runner's fixed buffers, never the batch being replayed."""

    def __init__(self, run: Callable[[], None]) -> None:
        self._run = run

    def replay(self) -> None:
        self._run()


def capture_cuda(forward: Callable[[], tuple], pool, stream, device: torch.device):
    """(graph, outputs) of forward() captured on `stream` into memory pool `pool`."""
    # Warm up outside the graph: compiles the Triton kernels and makes cuBLAS create its handles and
    # workspaces, none of which may happen during capture. On the capture stream, like the capture.
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = forward()
    return graph, out


def capture_emulated(forward: Callable[[], tuple]):
    """(EmulatedGraph, fixed outputs): a replay re-runs forward() and copies its results into the outputs."""
    first = forward()  # the warm-up, as on a GPU
    out = type(first)(*(torch.empty_like(t) for t in first))

    def run() -> None:
        for dst, src in zip(out, forward()):
            dst.copy_(src)

    return EmulatedGraph(run), out


def _padding(values: list[int], n: int, device: torch.device) -> torch.Tensor:
    """[len(values), n] int32 on the device, row i filled with values[i]."""
    return torch.tensor(values, dtype=torch.int32)[:, None].expand(len(values), n).contiguous().to(device)


Out = TypeVar("Out", bound=tuple)  # a NamedTuple of the graph's output tensors


class BaseGraphRunner(ABC, Generic[Out]):
    """Captures one graph per size into one memory pool and replays the smallest graph a batch fits in.

    A subclass says what differs: `_size_of` (what the sizes count), `_buffer_batch` (a batch whose
    tensors are the fixed buffers), `_forward` (what a graph computes), the attention backend's capture and
    replay hooks, `_copy_in` (a batch into the buffers, padding the rest) and `_result` (what comes out)."""

    label = "graphs"  # for logs

    def __init__(self, deps: GraphDeps, sizes: list[int]) -> None:
        self.deps = deps
        self.sizes = sizes
        self.emulate = not is_cuda(deps.device)
        self.dummy_row, self.dummy_slot = deps.dummy_row, deps.dummy_slot
        self.graphs: dict[int, torch.cuda.CUDAGraph | EmulatedGraph] = {}
        self.outputs: dict[int, Out] = {}  # size -> the fixed outputs of its graph
        self.replays = 0  # steps served by a graph (tests and logs read it)
        self._pool = torch.cuda.graph_pool_handle() if not self.emulate else None
        self._stream = torch.cuda.Stream(deps.device) if not self.emulate else None

    # ---- what a subclass says ----------------------------------------------------------------------
    @abstractmethod
    def can_run(self, batch: Batch) -> bool:
        """Whether some captured graph holds the batch."""

    @abstractmethod
    def _size_of(self, batch: Batch) -> int:
        """What the captured sizes count (requests for decode, tokens for prefill)."""

    @abstractmethod
    def _buffer_batch(self, size: int) -> Batch:
        """The batch a capture runs on: its tensors are views of the fixed buffers."""

    @abstractmethod
    def _forward(self, batch: Batch) -> Out:
        """What a graph computes, reading only the buffer batch."""

    @abstractmethod
    def _prepare_capture(self, batch: Batch, size: int) -> None:
        """The attention backend's capture hook (its metadata in its own fixed buffers)."""

    @abstractmethod
    def _copy_in(self, batch: Batch, size: int) -> None:
        """Copy the batch's inputs into the fixed buffers and pad them up to `size`."""

    @abstractmethod
    def _prepare_replay(self, batch: Batch) -> None:
        """The attention backend's replay hook (the batch's metadata into its fixed buffers)."""

    @abstractmethod
    def _result(self, batch: Batch, out: Out):
        """What replay() returns, from the graph's fixed outputs."""

    def _describe(self) -> str:
        return f"sizes {self.sizes[0]}..{self.sizes[-1]}"

    # ---- shared ------------------------------------------------------------------------------------
    def padded_size(self, n: int) -> int:
        """The smallest captured size that holds n."""
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size, largest first: the smaller graphs then reuse the shared pool's memory."""
        kind = f"emulated {self.label}" if self.emulate else f"CUDA {self.label}"
        device, start = self.deps.device, time.perf_counter()
        free_before = 0 if self.emulate else torch.cuda.mem_get_info(device)[0]
        order = sorted(self.sizes, reverse=True)
        for size in tqdm(order, desc=f"Capturing {kind}", unit="graph", disable=not self.deps.show_progress):
            self._capture_one(size)
        done = f"in {time.perf_counter() - start:.1f}s"
        if not self.emulate:
            done += f", {(free_before - torch.cuda.mem_get_info(device)[0]) / 2**20:.0f} MiB"
        logger.info(f"Captured {len(self.sizes)} {kind} ({self._describe()}) {done}")

    def _capture_one(self, size: int) -> None:
        batch = self._buffer_batch(size)
        self._prepare_capture(batch, size)

        def forward() -> Out:
            return self._forward(batch)

        if self.emulate:
            self.graphs[size], self.outputs[size] = capture_emulated(forward)
        else:
            self.graphs[size], self.outputs[size] = capture_cuda(
                forward, self._pool, self._stream, self.deps.device
            )

    def replay(self, batch: Batch):
        """Copy the batch's inputs into the fixed buffers (padding the rest), replay the graph of the
        smallest size that holds it, and return what the subclass takes from its fixed outputs."""
        size = self.padded_size(self._size_of(batch))
        self._copy_in(batch, size)
        self._prepare_replay(batch)
        self.graphs[size].replay()
        self.replays += 1
        return self._result(batch, self.outputs[size])


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
        self._pad = _padding(pad, self.max_bs, deps.device)
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

    def can_run(self, batch: Batch) -> bool:
        # a verify step runs eagerly: its rows of one request must store their K/V before any attends,
        # which the captured decode kernels (rotary and the store inside attention) do not guarantee
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


class PrefillGraphRunner(BaseGraphRunner[PrefillOutput]):
    """Prefill: the whole forward of a prefill batch padded to a captured token count.

    Every per-token input (ids, positions, KV slots) and per-request input (page-table row, the row to
    sample from) is copied into fixed buffers, and the attention backend copies its metadata (lengths,
    work list) into its own. Padding tokens sit at position 0 and write their K/V into the dummy slot (as
    decode padding does); no request's attention reads them, and no sampled row is one of them. Padding
    requests have no new tokens. The page-table entries of the batch are written before the replay (their
    count varies). The graph ends with the LM head on max_reqs rows (logits_idx); sampling runs after."""

    label = "prefill graphs"

    def __init__(self, deps: GraphDeps, sizes: list[int], max_reqs: int) -> None:
        super().__init__(deps, sizes)
        self.max_tokens, self.max_reqs = sizes[-1], max_reqs
        tok_pad = _PREFILL_TOKEN_INPUTS.ordered(input_ids=0, positions=0, out_loc=deps.dummy_slot)
        self._tok_pad = _padding(tok_pad, self.max_tokens, deps.device)
        self._tok = self._tok_pad.clone()
        req_pad = _PREFILL_REQ_INPUTS.ordered(table_idx=deps.dummy_row, logits_idx=0)
        self._req_pad = _padding(req_pad, max_reqs, deps.device)
        self._req = self._req_pad.clone()

    @classmethod
    def create(
        cls,
        deps: GraphDeps,
        max_tokens: int | None,
        max_prefill_length: int,
        max_running_req: int,
        graphs_off: bool = False,
    ) -> PrefillGraphRunner | None:
        """A runner with every size captured, or None: off (max_tokens 0, or None on a CPU or with every
        CUDA graph off, `graphs_off`) or an attention backend without prefill-graph hooks."""
        if max_tokens is None:
            on = is_cuda(deps.device) and not graphs_off
            max_tokens = min(DEFAULT_MAX_PREFILL, max_prefill_length) if on else 0
        if max_tokens <= 0:
            return None
        sizes = prefill_sizes(max_tokens)
        max_reqs = min(max_running_req, MAX_PREFILL_REQS)
        try:
            deps.attn_backend.init_prefill_graph(sizes[-1], max_reqs)
        except NotImplementedError:
            name = type(deps.attn_backend).__name__
            logger.info(f"{name} has no prefill-graph hooks: prefill runs eagerly")
            return None
        runner = cls(deps, sizes, max_reqs)
        runner.capture_all()
        return runner

    def can_run(self, batch: Batch) -> bool:
        return batch.is_prefill and batch.num_tokens <= self.max_tokens and batch.size <= self.max_reqs

    def _size_of(self, batch: Batch) -> int:
        return batch.num_tokens

    def _describe(self) -> str:
        return f"{self.sizes[0]}..{self.max_tokens} tokens, up to {self.max_reqs} requests"

    def _buffer_batch(self, num_tokens: int) -> Batch:
        """A prefill batch of max_reqs requests over num_tokens tokens whose tensors are the fixed buffers."""
        r = self.max_reqs
        batch = Batch([None] * r, Phase.PREFILL, [0] * r, [num_tokens] + [0] * (r - 1), [True] * r)
        _PREFILL_TOKEN_INPUTS.assign(batch, (row[:num_tokens] for row in self._tok.unbind(0)))
        _PREFILL_REQ_INPUTS.assign(batch, self._req.unbind(0))
        return batch

    def _forward(self, batch: Batch) -> PrefillOutput:
        hidden = self.deps.run_model(batch)
        return PrefillOutput(self.deps.compute_logits(hidden[batch.logits_idx.long()]))

    def _prepare_capture(self, batch: Batch, num_tokens: int) -> None:
        self.deps.attn_backend.prepare_prefill_capture(batch, num_tokens)

    def _copy_in(self, batch: Batch, n: int) -> None:
        # a prefill batch's page-table writes, outside the graph: their count varies
        self.deps.prepare_inputs(batch)
        t = batch.num_tokens
        for row, src in zip(self._tok, _PREFILL_TOKEN_INPUTS.of(batch)):
            row[:t].copy_(src, non_blocking=True)
        if n > t:  # padding tokens must not write K/V into slots a request owns
            self._tok[:, t:n].copy_(self._tok_pad[:, t:n], non_blocking=True)
        for row, pad, src in zip(self._req, self._req_pad, _PREFILL_REQ_INPUTS.of(batch)):
            k = src.numel()  # batch.size page-table rows; fewer rows to sample from
            row[:k].copy_(src, non_blocking=True)
            row[k:].copy_(pad[k:], non_blocking=True)  # stale rows could index past the tokens

    def _prepare_replay(self, batch: Batch) -> None:
        self.deps.attn_backend.prepare_prefill_replay(batch)

    def _result(self, batch: Batch, out: PrefillOutput) -> torch.Tensor:
        return out.logits[: batch.logits_idx.numel()]  # the sampled rows' logits
