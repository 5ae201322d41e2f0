"""The scheduler's side of speculative decoding: a verify step's batch, built from each request's proposals
(speculative.py: the proposers, each request's adaptive k, the step costs k is chosen from), and its
outcome, the agreeing proposals kept and the pages past them given back."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from minisgl.core import Batch, Phase, Req

from .prefill import pages_for
from .proposers import create_proposer
from .speculative import IDLE_REST, SpecState, StepCosts

if TYPE_CHECKING:
    from minisgl.engine import Engine

    from .batch_builder import BatchBuilder
    from .cache import CacheManager
    from .config import SchedulerConfig
    from .grammar import GrammarManager
    from .output import StepOutput


class Verifier:
    """Proposals checked by the target model in verify steps; `on` only with `--speculative`."""

    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheManager,
        batches: BatchBuilder,
        engine: Engine,
        emit: Callable[[Req, int, int, tuple | None], StepOutput],
        grammar: GrammarManager,
        overlap: bool = False,
    ) -> None:
        self.config, self.cache, self.batches, self.engine = config, cache, batches, engine
        self.grammar = grammar  # a constrained request's proposals are cut where its grammar rejects them
        self.page_size = config.page_size
        self.emit = emit  # gives a request one of the step's tokens (OutputProcessor.emit)
        # with overlap, a step that may propose first drains the step in flight: a request that found
        # nothing to propose rests a few steps, which then overlap as without speculation
        self.idle_rest = IDLE_REST if overlap else 0
        if config.speculative is not None:
            # a verify step has up to k + 1 rows for each of at most speculative_max_batch requests
            engine.capture_verify_graphs(config.speculative_max_batch * (config.num_speculative_tokens + 1))
        # speculative decoding (scheduler/speculative.py, proposers.py), None when off
        self.proposer = create_proposer(config, engine)
        self.spec_proposed = self.spec_accepted = self.spec_steps = 0
        self.step_costs = StepCosts()  # a lone request's steps by rows: what its k is chosen from

    @property
    def on(self) -> bool:
        return self.proposer is not None

    def wants(self, num_reqs: int) -> bool:
        """Whether a decode step of `num_reqs` requests may verify proposals."""
        return self.on and 0 < num_reqs <= self.config.speculative_max_batch

    def proposing(self, reqs: list[Req]) -> bool:
        """Whether any of the running requests proposes this step (those resting count one step down);
        called once a step while speculation is possible, before `prepare`. While none proposes, decode
        steps overlap as without speculation: nothing drains for proposals."""
        any_ready = False
        for r in reqs:
            if r.spec is None:
                r.spec = SpecState()
            r.spec.proposing = r.spec.ready()
            any_ready |= r.spec.proposing
        return any_ready

    def times_steps(self, batch: Batch, num_running: int) -> bool:
        """A decode or verify step while speculation is possible: its cost by rows chooses k (StepCosts).
        Not with several ranks: each would time its own steps, and they must all choose the same k."""
        return (
            self.on
            and self.config.tp_info.size == 1
            and batch.is_decode
            and num_running <= self.config.speculative_max_batch
        )

    def prepare(self, reqs: list[Req]) -> Batch | None:
        """A verify step: each request's proposals in rows after its last token (scheduler/speculative.py).
        None when no request has a proposal or the pool cannot hold them (a plain decode step then)."""
        max_k = self.config.num_speculative_tokens
        rooms = []
        for r in reqs:
            assert r.spec is not None  # `proposing` ran this step
            room = r.max_total_len - r.device_len - 1  # no proposals beyond the request's last position
            rooms.append(room if room > 0 and r.spec.proposing else 0)
        if self.config.tp_info.size > 1:
            ks = [min(r.spec.k(max_k), room) for r, room in zip(reqs, rooms)]
        else:  # the k of the most expected tokens per second of the step
            k = self.step_costs.best_k([r.spec.hit for r, m in zip(reqs, rooms) if m], len(reqs), max_k)
            for r, m in zip(reqs, rooms):
                if m and k == 0:  # decoding pays more
                    r.spec.pause()
                elif m and k is None:  # a decode step of this size is timed first: the next step rests,
                    r.spec.rest = max(r.spec.rest, 1)  # so that it overlaps this one (Scheduler.step)
            ks = [min(k or 0, room) for room in rooms]
        drafts = [d[:k] for d, k in zip(self.proposer.propose(reqs, ks), ks)] if any(ks) else []
        # under a grammar, only the proposals it accepts (the matchers are exact: the step was drained)
        drafts = [d if r.grammar is None else self.grammar.allowed_drafts(r, d) for r, d in zip(reqs, drafts)]
        for r, k, d in zip(reqs, ks, drafts or [[]] * len(reqs)):
            if k and not d:
                r.spec.rest = max(r.spec.rest, self.idle_rest)
        if not any(drafts):
            return None
        ps = self.page_size
        need = [pages_for(r.cached_len + len(d) + 1, ps) - len(r.pages) for r, d in zip(reqs, drafts)]
        pages = self.cache.alloc(sum(n for n in need if n > 0))
        if pages is None:
            return None  # no room for proposals: decode (which may retract) instead
        for r, n in zip(reqs, need):
            if n > 0:
                r.pages += pages[:n]
                del pages[:n]
        order = sorted(range(len(reqs)), key=lambda i: reqs[i].cached_len, reverse=True)
        rows: list[Req] = []
        positions: list[int] = []
        row_drafts: list[int] = []
        drawn_at: list[int] = []  # the rows whose proposal was drawn from a distribution, and those
        drawn_from: list[torch.Tensor] = []
        for i in order:
            r, d = reqs[i], drafts[i]
            q = self.proposer.draft_probs(r) if d else None
            if q is not None:
                drawn_at += range(len(rows), len(rows) + len(d))
                drawn_from += q[: len(d)]
            rows += [r] * (len(d) + 1)
            positions += range(r.cached_len, r.cached_len + len(d) + 1)
            row_drafts += [*d, -1]
            r.table_len = r.cached_len + len(d) + 1
        n = len(rows)
        out_loc = [r.pages[p // ps] * ps + p % ps for r, p in zip(rows, positions)]
        batch = Batch(rows, Phase.DECODE, positions, [1] * n, [True] * n)
        batch.drafts = row_drafts
        # proposal i goes into the token pool at the position after its row, where row i + 1 reads it;
        # a request's last row writes nothing (into the unused dummy row)
        dummy = self.engine.dummy_row
        has = [t >= 0 for t in row_drafts]
        writes = (
            [r.table_idx if h else dummy for r, h in zip(rows, has)],
            [p + 1 if h else 0 for p, h in zip(positions, has)],
            [t if h else 0 for t, h in zip(row_drafts, has)],
        )
        self.batches.to_device(batch, positions, out_loc, [p + 1 for p in positions], spec_parts=writes)
        if drawn_at:  # checked by speculative_sample (engine/sampler.py) instead of by equality alone
            at = torch.tensor([drawn_at, [row_drafts[j] for j in drawn_at]], dtype=torch.int64)
            at = at.to(self.engine.device, non_blocking=True)
            batch.draft_probs = (at[0], at[1], torch.stack(drawn_from))
        for r in reqs:  # the base row, as in decode; accepted proposals advance further when processed
            r.cached_len += 1
            r.device_len += 1
        self.spec_steps += 1
        return batch

    def process(self, batch: Batch, tokens: list[int], logprobs: tuple | None) -> list[StepOutput]:
        """A verify step's rows, request by request: the tokens up to and including the first row whose
        token differs from the proposal it checks (the last row checks none). Each agreeing row makes its
        proposal's KV valid; the pages past the request's valid KV go back to the pool."""
        assert batch.drafts is not None
        drafts, reqs, n = batch.drafts, batch.reqs, len(tokens)
        results: list[StepOutput] = []
        i = 0
        while i < n:
            req, start = reqs[i], i
            while drafts[i] >= 0:  # a request's rows end with the one that checks nothing
                i += 1
            end, i = i, i + 1
            if req.finished:  # aborted since: its rows are discarded
                continue
            accepted = 0
            for row in range(start, end + 1):
                res = self.emit(req, tokens[row], row, logprobs)
                results.append(res)
                if res.finished or tokens[row] != drafts[row]:
                    break
                accepted += 1  # the proposal is the token: its KV (row + 1's input) is valid
                req.cached_len += 1
                req.device_len += 1
            self.spec_proposed += end - start
            self.spec_accepted += accepted
            req.spec.update(end - start, accepted)
            self.proposer.on_accept(req, accepted)
            if not req.finished:
                keep = pages_for(req.cached_len, self.page_size)
                self.cache.free(req.pages[keep:])
                del req.pages[keep:]
        return results
