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

from minisgl import kernel
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


def capture_each(engine: Engine, sizes: list[int], kind: str, capture_one: Callable[[int], None]) -> str:
    """capture_one(size) for every size, largest first, under a progress bar; returns "in <time>[, <memory>]"."""
    start = time.perf_counter()
    emulate = not is_cuda(engine.device)
    free_before = 0 if emulate else torch.cuda.mem_get_info(engine.device)[0]
    show = engine.config.show_progress and engine.config.tp_info.is_primary()
    for size in tqdm(sorted(sizes, reverse=True), desc=f"Capturing {kind}", unit="graph", disable=not show):
        capture_one(size)
    used = "" if emulate else f", {(free_before - torch.cuda.mem_get_info(engine.device)[0]) / 2**20:.0f} MiB"
    return f"in {time.perf_counter() - start:.1f}s{used}"


def capture_emulated(forward: Callable[[], tuple]):
    """(EmulatedGraph, fixed outputs): a replay re-runs forward() and copies its results into the outputs."""
    first = forward()  # the warm-up, as on a GPU
    out = type(first)(*(torch.empty_like(t) for t in first))

    def run() -> None:
        for dst, src in zip(out, forward()):
            dst.copy_(src)

    return EmulatedGraph(run), out


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
                logger.warning(
                    f"{type(engine.attn_backend).__name__} cannot be captured: CUDA graphs disabled"
                )
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
        tokens = kernel.argmax(logits)
        engine.token_pool[batch.table_idx, batch.positions + 1] = tokens
        return GraphOutput(hidden, logits, tokens)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size, largest first: the smaller graphs then reuse the shared pool's memory."""
        kind = "emulated graphs" if self.emulate else "CUDA graphs"
        done = capture_each(self.engine, self.sizes, kind, self._capture_one)
        logger.info(f"Captured {len(self.sizes)} {kind} (batch sizes {self.sizes[0]}..{self.max_bs}) {done}")

    def _capture_one(self, bs: int) -> None:
        batch = self._buffer_batch(bs)
        if self.backend_hooks:
            self.engine.attn_backend.prepare_for_capture(batch)
        capture = self._capture_emulated if self.emulate else self._capture_cuda
        self.graphs[bs], self.outputs[bs] = capture(batch)

    def _capture_cuda(self, batch: Batch):
        return capture_cuda(lambda: self._forward(batch), self._pool, self._stream, self.engine.device)

    def _capture_emulated(self, batch: Batch):
        plan = not self.backend_hooks
        return capture_emulated(lambda: self._forward(batch, plan))

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


# ---- prefill ---------------------------------------------------------------------------------------------
DEFAULT_MAX_PREFILL = 8192  # tokens, on a GPU when --cuda-graph-max-prefill is not given
MAX_PREFILL_REQS = 64  # requests a captured prefill batch holds at most


class PrefillOutput(NamedTuple):
    logits: torch.Tensor  # [max_reqs, vocab]: the logits of the rows in logits_idx, in its order


def prefill_sizes(max_tokens: int) -> list[int]:
    """Token counts captured for prefill: 16, 32, .., 1024, then every 1024 up to max_tokens (always
    included). Above 1024 tokens padding adds at most a third, where the step time is ~linear."""
    sizes = [16 << i for i in range(7)] + list(range(2048, max_tokens + 1, 1024))
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


class PrefillGraphRunner:
    """CUDA graphs for prefill: the whole forward of a prefill batch padded to a captured token count.

    A large prefill step launches ~10 kernels a layer whose host cost (Triton's and cuBLAS's launch
    paths) can exceed the GPU time of the step; a replay launches them all at once. Every per-token input
    (ids, positions, KV slots) and per-request input (page-table row, the row to sample from) is copied
    into fixed buffers, and the attention backend copies its metadata (lengths, work list) into its own.
    Padding tokens sit at position 0 and write their K/V into the dummy slot (as decode padding does);
    no request's attention reads them, and no sampled row is one of them. Padding requests have no new
    tokens. The page-table entries of the batch are written before the replay (their count varies).
    The graph ends with the LM head on max_reqs rows (logits_idx); sampling runs after the replay.
    """

    def __init__(self, engine: Engine, sizes: list[int], max_reqs: int) -> None:
        self.engine = engine
        self.sizes = sizes
        self.max_tokens, self.max_reqs = sizes[-1], max_reqs
        self.emulate = not is_cuda(engine.device)
        device = engine.device
        dummy_row, dummy_slot = engine.config.max_running_req, engine.num_pages * engine.config.page_size
        engine.page_table[dummy_row].fill_(dummy_slot)
        # per token: input id, position, KV slot; per request: page-table row, the row to sample from
        self._tok_pad = torch.tensor([0, 0, dummy_slot], dtype=torch.int32)[:, None].expand(
            3, self.max_tokens
        )
        self._tok_pad = self._tok_pad.contiguous().to(device)
        self._tok = self._tok_pad.clone()
        self._req_pad = torch.tensor([dummy_row, 0], dtype=torch.int32)[:, None].expand(2, max_reqs)
        self._req_pad = self._req_pad.contiguous().to(device)
        self._req = self._req_pad.clone()
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, PrefillOutput] = {}
        self.replays = 0  # prefill steps served by a graph (tests and logs read it)
        self._pool = torch.cuda.graph_pool_handle() if not self.emulate else None
        self._stream = torch.cuda.Stream(device) if not self.emulate else None

    @classmethod
    def create(cls, engine: Engine) -> PrefillGraphRunner | None:
        """A runner with every size captured, or None: off (cuda_graph_max_prefill 0, or None on a CPU or
        with decode graphs off) or an attention backend without prefill-graph hooks."""
        cfg = engine.config
        limit = cfg.cuda_graph_max_prefill
        if limit is None:
            on = is_cuda(engine.device) and cfg.cuda_graph_max_bs != 0
            limit = min(DEFAULT_MAX_PREFILL, cfg.max_prefill_length) if on else 0
        if limit <= 0:
            return None
        sizes = prefill_sizes(limit)
        max_reqs = min(cfg.max_running_req, MAX_PREFILL_REQS)
        try:
            engine.attn_backend.init_prefill_graph(sizes[-1], max_reqs)
        except NotImplementedError:
            logger.info(
                f"{type(engine.attn_backend).__name__} has no prefill-graph hooks: prefill runs eagerly"
            )
            return None
        runner = cls(engine, sizes, max_reqs)
        runner.capture_all()
        return runner

    def _buffer_batch(self, num_tokens: int) -> Batch:
        """A prefill batch of max_reqs requests over num_tokens tokens whose tensors are the fixed buffers."""
        r = self.max_reqs
        batch = Batch([None] * r, "prefill", [0] * r, [num_tokens] + [0] * (r - 1), [True] * r)
        batch.input_ids, batch.positions, batch.out_loc = (t[:num_tokens] for t in self._tok.unbind(0))
        batch.table_idx, batch.logits_idx = self._req.unbind(0)
        return batch

    def _forward(self, batch: Batch) -> PrefillOutput:
        engine = self.engine
        with engine.ctx.forward_batch(batch):
            hidden = engine.model()
        return PrefillOutput(engine.model.compute_logits(hidden[batch.logits_idx.long()]))

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size, largest first, into one memory pool."""
        kind = "emulated prefill graphs" if self.emulate else "prefill CUDA graphs"
        done = capture_each(self.engine, self.sizes, kind, self._capture_one)
        logger.info(
            f"Captured {len(self.sizes)} {kind} ({self.sizes[0]}..{self.max_tokens} tokens, up to "
            f"{self.max_reqs} requests) {done}"
        )

    def _capture_one(self, num_tokens: int) -> None:
        batch = self._buffer_batch(num_tokens)
        self.engine.attn_backend.prepare_prefill_capture(batch, num_tokens)
        if self.emulate:
            self.graphs[num_tokens], self.outputs[num_tokens] = capture_emulated(lambda: self._forward(batch))
        else:
            self.graphs[num_tokens], self.outputs[num_tokens] = capture_cuda(
                lambda: self._forward(batch), self._pool, self._stream, self.engine.device
            )

    def can_run(self, batch: Batch) -> bool:
        return batch.is_prefill and batch.num_tokens <= self.max_tokens and batch.size <= self.max_reqs

    def replay(self, batch: Batch) -> torch.Tensor:
        """Write the batch's page-table entries, copy its inputs into the fixed buffers (padding the rest),
        replay the graph of the smallest size that holds its tokens; returns the sampled rows' logits."""
        engine = self.engine
        # a prefill batch's page-table writes, outside the graph: their count varies
        engine.prepare_inputs(batch)
        t, n = batch.num_tokens, self.sizes[bisect.bisect_left(self.sizes, batch.num_tokens)]
        for i, src in enumerate((batch.input_ids, batch.positions, batch.out_loc)):
            self._tok[i, :t].copy_(src, non_blocking=True)
        if n > t:  # padding tokens must not write K/V into slots a request owns
            self._tok[:, t:n].copy_(self._tok_pad[:, t:n], non_blocking=True)
        r = batch.size
        self._req[0, :r].copy_(batch.table_idx, non_blocking=True)
        s = batch.logits_idx.numel()
        self._req[1, :s].copy_(batch.logits_idx, non_blocking=True)
        self._req[:, r:].copy_(self._req_pad[:, r:], non_blocking=True)  # stale rows could index past n
        self._req[1, s:].copy_(self._req_pad[1, s:], non_blocking=True)
        engine.attn_backend.prepare_prefill_replay(batch)
        self.graphs[n].replay()
        self.replays += 1
        return self.outputs[n].logits[:s]
