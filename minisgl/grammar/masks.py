"""The per-step token masks of the constrained rows: a matcher per request, the bitmask filled on the host
and applied to the logits."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from minisgl.core import Req
from minisgl.utils import init_logger
from minisgl.utils.device import HostRing

logger = init_logger(__name__)

from .checks import load_xgrammar

BATCH_FILL_MIN = 8  # constrained rows from which a GPU step fills their masks on several threads


def new_matcher(compiled: Any) -> Any:
    """A fresh matcher (xgrammar GrammarMatcher) of a compiled grammar, for one request."""
    return load_xgrammar().GrammarMatcher(compiled)


@dataclass
class TokenMask:
    """A batch's allowed tokens on the device: `bits` [n, ceil(V/32)] int32, one row per constrained
    sampled row; `rows` [n] their indices among the sampled rows (None: every sampled row, in order),
    on the device and (`host_rows`) as a list."""

    bits: torch.Tensor
    rows: torch.Tensor | None
    host_rows: list[int]


class TokenMasks:
    """Fills the token bitmasks of a batch's constrained rows on the host, through pinned buffers. With
    a GPU, many rows are filled by xgrammar's thread pool (on a CPU the cores run the model)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.width = (vocab_size + 31) // 32
        self.device = device
        self._ring = HostRing(device)
        self.threads = 1 if device.type == "cpu" else min(8, max(1, (os.cpu_count() or 2) // 2))
        self._batch: Any = None  # xgrammar BatchGrammarMatcher, made at the first large batch

    def fill(
        self, reqs: list[Req], rows: list[int], num_sampled: int, drafts: list[int] | None = None
    ) -> TokenMask:
        """The mask of sampled rows `rows` (their requests `reqs`, in order) of a batch sampling
        `num_sampled` rows. A finished request's row (its token will be discarded) allows everything.
        A verify step gives each row's proposal (`drafts`, -1 at a request's last row): a request's rows
        are consecutive, and each row's mask is the one after the proposals of the rows before it."""
        n = len(rows)
        buf, slot = self._ring.take(n * self.width)
        bits = buf[: n * self.width].view(n, self.width)
        live = []
        for k, req in enumerate(reqs):
            if req.finished or req.grammar is None:
                bits[k].fill_(-1)
            else:
                live.append(k)
        if drafts is not None:
            _fill_ahead(reqs, drafts, bits, set(live))
        elif self.threads > 1 and len(live) >= BATCH_FILL_MIN:
            if self._batch is None:
                self._batch = load_xgrammar().BatchGrammarMatcher(self.threads)
            self._batch.batch_fill_next_token_bitmask([reqs[k].grammar for k in live], bits, live)
        else:
            for k in live:
                reqs[k].grammar.fill_next_token_bitmask(bits, k)
        dev = bits.to(self.device, non_blocking=True)
        self._ring.used(slot)  # the buffer is handed out again once this copy is done
        every = n == num_sampled  # rows are ascending and distinct: all of them means 0..n-1
        index = None
        if not every and self.device.type != "cpu":
            index = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        return TokenMask(dev, index, list(range(n)) if every else rows)


def _fill_ahead(reqs: list[Req], drafts: list[int], bits: torch.Tensor, live: set[int]) -> None:
    """Fill a verify step's rows: after each row the matcher accepts the row's proposal, and at the
    request's last row it rolls back the proposals, so it ends where it started (the tokens kept are
    accepted once the step's result is known)."""
    ahead = 0
    for k, req in enumerate(reqs):
        if k not in live:
            continue
        req.grammar.fill_next_token_bitmask(bits, k)
        if drafts[k] >= 0:
            # the scheduler kept only proposals the grammar accepts (GrammarManager.allowed_drafts)
            accepted = req.grammar.accept_token(drafts[k])
            assert accepted, f"request {req.uid}: proposal {drafts[k]} is outside its grammar"
            ahead += 1
        elif ahead:
            req.grammar.rollback(ahead)
            ahead = 0


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> None:
    """Set the logits of the tokens a constrained row may not take to -inf, in place (xgrammar's kernel:
    Triton on a GPU, C++ on a CPU); the other rows are untouched."""
    apply, width = load_xgrammar().apply_token_bitmask_inplace, logits.shape[-1]
    if len(mask.host_rows) == logits.shape[0]:
        apply(logits, mask.bits, vocab_size=width)
    elif logits.device.type == "cpu":  # row by row on views: no copy of the logits
        for k, row in enumerate(mask.host_rows):
            apply(logits[row], mask.bits[k], vocab_size=width)
    else:  # one kernel over the constrained rows, gathered
        sub = logits.index_select(0, mask.rows)
        apply(sub, mask.bits, vocab_size=width)
        logits.index_copy_(0, mask.rows, sub)
