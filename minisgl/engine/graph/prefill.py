"""Prefill graphs: the whole forward of a prefill batch padded to a captured token count
(`PrefillGraphRunner`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from minisgl.core import Batch, Phase
from minisgl.utils import init_logger
from minisgl.utils.device import is_cuda

from .base import BaseGraphRunner, GraphDeps, InputRows, padding
from .sizes import DEFAULT_MAX_PREFILL, MAX_PREFILL_REQS, prefill_sizes

logger = init_logger(__name__)

# A prefill graph's fixed inputs: per token, and per request (the row to sample from may be shorter)
_PREFILL_TOKEN_INPUTS = InputRows(("input_ids", "positions", "out_loc"))
_PREFILL_REQ_INPUTS = InputRows(("table_idx", "logits_idx"))


class PrefillOutput(NamedTuple):
    """A prefill graph's fixed output."""

    logits: torch.Tensor  # [max_reqs, vocab]: the logits of the rows in logits_idx, in its order


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
        self._tok_pad = padding(tok_pad, self.max_tokens, deps.device)
        self._tok = self._tok_pad.clone()
        req_pad = _PREFILL_REQ_INPUTS.ordered(table_idx=deps.dummy_row, logits_idx=0)
        self._req_pad = padding(req_pad, max_reqs, deps.device)
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
