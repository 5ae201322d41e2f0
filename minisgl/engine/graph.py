"""CUDA graphs for decode: capture the model's forward once per batch size, replay it every step.

Decode at small batch sizes is launch-bound, so replaying one graph instead of launching hundreds of kernels
matters more than any kernel. A graph replays fixed device addresses, so every input of a step is copied
into fixed buffers first (positions, KV write slots, page-table rows, sequence lengths: one copy), and a
batch is padded to the nearest captured size. Everything else a decode step does on the device is inside
the graph too: the page-table entries of the new tokens, reading the input tokens from the token pool,
the LM head, the greedy token (argmax) and writing it into the token pool. A batch that samples replaces
the greedy tokens afterwards from the graph's logits.

Padding rows are complete one-token requests that touch nothing real: they read page-table row
`max_running_req` (the engine's extra dummy row) and write their K/V into the dummy KV slot, the first slot
of the one page the engine allocates beyond `num_pages` (the scheduler never hands it out). Their position
is 0 and their sequence length 1, and the dummy row maps position 0 to the dummy slot, so a padding row
attends to exactly the key it wrote.

On a CPU (when asked for with `cuda_graph_max_bs > 0`) an EmulatedGraph stands in: its "capture" records
a closure that reads only the fixed buffers, so an input that replay forgets to copy gives a wrong result
on a CPU too, and the tests catch it.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
from tqdm import tqdm

from minisgl.core import Batch
from minisgl.utils import init_logger
from minisgl.utils.device import is_cuda

if TYPE_CHECKING:
    from .engine import Engine

logger = init_logger(__name__)

DEFAULT_MAX_BS = 256  # on a GPU when --cuda-graph-max-bs is not given


class GraphOutput(NamedTuple):
    """A graph's fixed outputs, [padded size, ...], rows in batch order."""

    hidden: torch.Tensor  # the final hidden states
    logits: torch.Tensor
    tokens: torch.Tensor  # int32 argmax of the logits, already written into the token pool


def capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 128 and every 16 beyond, up to max_bs (always included): padding
    wastes at most 15 rows of a large batch, where the step time grows slowly with the batch size."""
    sizes = [1, 2, 4, 8] + list(range(16, 129, 8)) + list(range(144, max_bs + 1, 16))
    return sorted({s for s in sizes if s < max_bs} | {max_bs})


class EmulatedGraph:
    """Stands in for torch.cuda.CUDAGraph on a CPU: replay() re-runs the closure recorded at capture,
    which reads only the graph runner's fixed buffers, never the batch being replayed."""

    def __init__(self, run: Callable[[], None]) -> None:
        self._run = run

    def replay(self) -> None:
        self._run()


class GraphRunner:
    """Captures decode at a list of batch sizes and replays the smallest graph a batch fits in."""

    # rows of the fixed int32 input buffer, in order (Batch.graph_inputs has the same rows)
    FIELDS = ("positions", "out_loc", "table_idx", "seq_lens")

    def __init__(self, engine: Engine, sizes: list[int], backend_hooks: bool) -> None:
        self.engine = engine
        self.sizes = sizes
        self.max_bs = sizes[-1]
        self.backend_hooks = backend_hooks  # False: CPU emulation recomputing metadata (torch backend)
        self.emulate = not is_cuda(engine.device)
        device, cfg = engine.device, engine.config
        self.dummy_row = cfg.max_running_req
        self.dummy_slot = engine.num_pages * cfg.page_size
        assert engine.page_table.shape[0] > self.dummy_row, "the engine allocates max_running_req + 1 rows"
        assert engine.kv_pool.num_slots > self.dummy_slot, "the engine allocates one page beyond num_pages"
        # padding values per field: position 0 of the dummy row, writing the dummy slot
        pad = torch.tensor([0, self.dummy_slot, self.dummy_row, 1], dtype=torch.int32)
        self._pad = pad[:, None].expand(len(self.FIELDS), self.max_bs).contiguous().to(device)
        self._inputs = self._pad.clone()  # the fixed buffers, one row per field
        self.positions, self.out_loc, self.table_idx, self.seq_lens = self._inputs.unbind(0)
        engine.page_table[self.dummy_row].fill_(self.dummy_slot)
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, GraphOutput] = {}  # bs -> the fixed outputs of its graph
        self._pool = torch.cuda.graph_pool_handle() if not self.emulate else None
        self._stream = torch.cuda.Stream(device) if not self.emulate else None

    @classmethod
    def create(cls, engine: Engine) -> GraphRunner | None:
        """A runner with every size captured, or None: graphs disabled (cuda_graph_max_bs 0), a CPU
        without an explicit cuda_graph_max_bs > 0, or a CUDA attention backend without graph hooks."""
        cfg = engine.config
        cuda = is_cuda(engine.device)
        max_bs = cfg.cuda_graph_max_bs
        if max_bs == 0 or (max_bs is None and not cuda):
            return None
        max_bs = min(max_bs or DEFAULT_MAX_BS, cfg.max_running_req)
        sizes = capture_sizes(max_bs)
        try:
            engine.attn_backend.init_capture_graph(max_bs, sizes)
            hooks = True
        except NotImplementedError:
            if cuda:
                logger.warning(f"{type(engine.attn_backend).__name__} cannot be captured: CUDA graphs disabled")
                return None
            hooks = False  # CPU emulation can recompute the metadata from the buffers at replay
        runner = cls(engine, sizes, hooks)
        runner.capture_all()
        return runner

    # ---- capture ---------------------------------------------------------------------------------
    def _buffer_batch(self, bs: int) -> Batch:
        """A decode batch of size bs whose tensors are views of the fixed buffers."""
        batch = Batch([None] * bs, "decode", [0] * bs, [1] * bs, [True] * bs)  # reqs: only the count matters
        batch.positions, batch.out_loc = self.positions[:bs], self.out_loc[:bs]
        batch.table_idx, batch.seq_lens_t = self.table_idx[:bs], self.seq_lens[:bs]
        batch.padded_size = bs
        return batch

    def _forward(self, batch: Batch, plan_from_buffers: bool = False) -> GraphOutput:
        """What a graph holds: the whole decode step but sampling (see the module docstring)."""
        engine = self.engine
        engine.prepare_inputs(batch)
        if plan_from_buffers:
            # A backend without graph hooks (torch, CPU only) plans from host lengths: take them from the
            # fixed buffer, never from the batch being replayed.
            batch.prefix_lens = [n - 1 for n in batch.seq_lens_t.tolist()]
            engine.attn_backend.prepare_metadata(batch)
        with engine.ctx.forward_batch(batch):
            hidden = engine.model()
        logits = engine.model.compute_logits(hidden)
        tokens = logits.argmax(dim=-1).to(torch.int32)
        engine.token_pool[batch.table_idx, batch.positions + 1] = tokens
        return GraphOutput(hidden, logits, tokens)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size, largest first: the smaller graphs then reuse the shared pool's memory."""
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.engine.device)[0] if not self.emulate else 0
        show = self.engine.config.show_progress and self.engine.config.tp_info.is_primary()
        kind = "emulated graphs" if self.emulate else "CUDA graphs"
        for bs in tqdm(sorted(self.sizes, reverse=True), desc=f"Capturing {kind}", unit="graph", disable=not show):
            batch = self._buffer_batch(bs)
            if self.backend_hooks:
                self.engine.attn_backend.prepare_for_capture(batch)
            if self.emulate:
                self.graphs[bs], self.outputs[bs] = self._capture_emulated(batch)
            else:
                self.graphs[bs], self.outputs[bs] = self._capture_cuda(batch)
        used = (free_before - torch.cuda.mem_get_info(self.engine.device)[0]) / 2**20 if not self.emulate else 0
        logger.info(f"Captured {len(self.sizes)} {kind} (batch sizes {self.sizes[0]}..{self.max_bs}) in "
                    f"{time.perf_counter() - start:.1f}s" + (f", {used:.0f} MiB" if not self.emulate else ""))

    def _capture_cuda(self, batch: Batch):
        stream = self._stream
        # Warm up outside the graph: compiles the Triton kernels and makes cuBLAS create its handles and
        # workspaces, none of which may happen during capture. On the capture stream, like the capture.
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(batch)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize(self.engine.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            out = self._forward(batch)
        return graph, out

    def _capture_emulated(self, batch: Batch):
        plan = not self.backend_hooks
        out = GraphOutput(*(torch.empty_like(t) for t in self._forward(batch, plan)))  # the warm-up, as on a GPU

        def run() -> None:
            for dst, src in zip(out, self._forward(batch, plan)):
                dst.copy_(src)

        return EmulatedGraph(run), out

    # ---- replay ----------------------------------------------------------------------------------
    def can_run(self, batch: Batch) -> bool:
        return batch.is_decode and batch.size <= self.max_bs

    def padded_size(self, n: int) -> int:
        """The smallest captured batch size that holds n requests."""
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def replay(self, batch: Batch) -> GraphOutput:
        """Copy the batch's inputs into the fixed buffers (padding the rest) and replay the graph of the
        padded size; returns its fixed outputs (the first batch.size rows are the batch's)."""
        n = batch.size
        bs = self.padded_size(n)
        batch.padded_size = bs
        inputs = batch.graph_inputs  # the scheduler packs them; a batch built by hand gets them stacked
        if inputs is None:
            inputs = torch.stack([batch.positions, batch.out_loc, batch.table_idx, batch.seq_lens_t])
        self._inputs[:, :n].copy_(inputs, non_blocking=True)
        if bs > n:  # rows a larger batch left behind would write K/V into slots they no longer own
            self._inputs[:, n:bs].copy_(self._pad[:, n:bs], non_blocking=True)
        if self.backend_hooks:
            self.engine.attn_backend.prepare_for_replay(batch)
        self.graphs[bs].replay()
        return self.outputs[bs]
