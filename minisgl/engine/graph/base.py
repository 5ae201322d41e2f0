"""What every graph runner shares: the fixed-input layouts (`InputRows`), what a runner gets from the engine
(`GraphDeps`), capture on a GPU or emulated on a CPU, and `BaseGraphRunner` (capture every size into one
memory pool, replay the smallest graph that holds a batch)."""

from __future__ import annotations

import bisect
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import torch
from tqdm import tqdm

from minisgl import kernel
from minisgl.core import Batch
from minisgl.utils import init_logger
from minisgl.utils.device import is_cuda

if TYPE_CHECKING:
    from minisgl.attention.base import BaseAttnBackend

logger = init_logger(__name__)


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


def padding(values: list[int], n: int, device: torch.device) -> torch.Tensor:
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
