"""Speculative decoding: proposers guess the tokens that follow a request, the target model checks them.

A proposer suggests up to k tokens per request (`Proposer.propose`); the scheduler verifies them in one
decode step over k + 1 rows per request (scheduler.py `_prepare_decode`): row i computes position
`cached_len + i`, its input the request's last token (i = 0) or proposal i, so it yields the target's token
after proposal i. Rows of one request share its page-table row; each writes its own KV slot before any row
attends, so row i sees the proposals before it as a prefill would. The engine samples every row as it
samples a decode row (greedy: the argmax; sampled: the target's processed distribution p, with the same
noise keys), and the request keeps the longest run of proposals equal to the rows' tokens, plus the next
row's token; the KV of the rest is overwritten later, their extra pages freed. A proposal d is checked
by the rejection scheme of speculative sampling, in one of two forms, so that every token is distributed
as without speculation:
- d a guess (an n-gram's token, a draft's argmax or a seeded request's draft draw): kept exactly when
  the target's own draw equals it, so with probability p(d); when it is not, the draw is distributed as p
  without d, renormalised. A seeded request gives the very same tokens with speculation as without.
- d drawn from a distribution q that the proposer gives (`Proposer.draft_probs`: the draft model's, for
  a sampled request without a seed): the row's token is `speculative_sample`'s (engine/sampler.py), d
  with probability min(1, p(d) / q(d)), else a draw from max(p - q, 0) renormalised, which is never d.
  d is kept with probability sum min(p, q), against p(argmax q) for the draft's argmax.

A new proposer (an EAGLE-style head) is one `Proposer` subclass registered in `PROPOSERS`
(scheduler/proposers.py); the draft model's is scheduler/draft.py.
Each request's k adapts to how often its proposals were accepted (`SpecState`): a request whose proposals
keep failing stops proposing for a while, so it costs nothing more than a decode step. With one rank, k
is the one that maximises the step's expected tokens per second, from the requests' acceptance and the
measured cost of a step by its rows (`StepCosts`): on a CPU a verify row costs a fraction of a decode
step that jumps where the kernels change their tiling, and a batch of several requests pays for every
row, so the best k is not simply the largest."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from minisgl.core import Req
    from minisgl.engine import Engine

    from .config import SchedulerConfig

# adaptive k: acceptance is an exponential average over verify steps; below POOR the request rests for
# REST steps (proposes nothing), then tries again from TRY_AGAIN
SMOOTHING = 0.3
POOR, REST, TRY_AGAIN = 0.15, 16, 0.4
# with overlap, the steps a request rests after it had nothing to propose (Verifier.prepare)
IDLE_REST = 3


COST_SMOOTHING = 0.2
# the cost of an extra row while only one row count is timed, in decode steps of one row: optimistic, so that a
# verify step gets tried; once two row counts are timed, the others are interpolated from them
UNMEASURED_ROW = 0.25


@dataclass
class SpecState:
    """One request's speculation state, kept on `Req.spec`: the proposer's own state and the adaptive k."""

    acceptance: float = 1.0  # exponential average of accepted / proposed
    # exponential average of the chance that a proposal is accepted given the ones before it were (each
    # verify step is a run of accepted proposals ended by a rejection or by the last one)
    hit: float = 0.8
    rest: int = 0  # decode steps left without proposing
    proposing: bool = False  # whether it proposes this step (Verifier.proposing)
    proposer: dict = field(default_factory=dict)  # the proposer's per-request data

    def ready(self) -> bool:
        """Whether the request proposes this step (False while it rests; each call is one step)."""
        if self.rest > 0:
            self.rest -= 1
            return False
        return True

    def k(self, max_k: int) -> int:
        """Tokens to propose from the acceptance alone (several ranks: no timings to go by)."""
        return max(1, min(max_k, round(max_k * self.acceptance)))

    def pause(self) -> None:
        """Proposing does not pay now: rest, then try again."""
        self.rest = REST
        self.hit, self.acceptance = max(self.hit, TRY_AGAIN), max(self.acceptance, TRY_AGAIN)

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.acceptance += SMOOTHING * (accepted / proposed - self.acceptance)
        trials = accepted + (accepted < proposed)
        self.hit += SMOOTHING * (accepted / trials - self.hit)
        if self.acceptance < POOR:
            self.pause()


class StepCosts:
    """Seconds of a decode or verify step by its rows, exponential averages of the steps run while few
    requests decode (the only steps that may speculate). A row count not timed yet costs what the timed
    ones around it say (`cost`)."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def add(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else old + COST_SMOOTHING * (seconds - old)

    def cost(self, rows: int) -> float | None:
        """Seconds of a step of `rows` rows: as timed; else on the line between the nearest timed row
        counts below and above; above every timed one, on the line through the two largest (never
        falling), or with one timed count c, UNMEASURED_ROW of c's cost per row for each extra row.
        None when nothing is timed."""
        if rows in self.seconds:
            return self.seconds[rows]
        below = [r for r in self.seconds if r < rows]
        above = [r for r in self.seconds if r > rows]
        if not below:
            return self.seconds[min(above)] if above else None
        r0 = max(below)
        if above:
            r1 = min(above)
        elif len(below) > 1:
            r1, r0 = r0, max(r for r in below if r < r0)
        else:
            return self.seconds[r0] * (1 + UNMEASURED_ROW * (rows - r0) / r0)
        slope = (self.seconds[r1] - self.seconds[r0]) / (r1 - r0)
        if not above:  # past the largest timed count: from it, never falling
            return self.seconds[r1] + max(slope, 0.0) * (rows - r1)
        return self.seconds[r0] + slope * (rows - r0)

    def best_k(self, hits: list[float], n: int, max_k: int) -> int | None:
        """For a step of n requests, `hits` those that may propose (their chance that a proposal after
        accepted ones is accepted): the k of the most expected tokens per second, each proposing request
        expecting 1 + h + ... + h^k over a step of n + k * len(hits) rows (`cost`); 0 when a plain decode
        step is best; None when a decode step of n rows was never timed (run one first)."""
        decode = self.seconds.get(n)
        if decode is None:
            return None
        best, best_rate, tokens = 0, n / decode, float(n)
        for k in range(1, max_k + 1):
            tokens += sum(h**k for h in hits)
            cost = self.cost(n + k * len(hits))
            if cost > 0 and tokens / cost > best_rate:
                best, best_rate = k, tokens / cost
        return best


class Proposer(ABC):
    """Proposes the tokens that may follow each request's known tokens (prompt and output so far).

    The scheduler builds one from its config (`create`), asks it for proposals before each verify step
    (`propose`) and for the distributions it drew them from, if it drew them (`draft_probs`), tells it how many of a request's proposals the target kept (`on_accept`), and lets it
    drop a request's state when the request finishes, is aborted or is retracted (`release`)."""

    @classmethod
    def create(cls, config: SchedulerConfig, target: Engine) -> Proposer:
        """The proposer the options ask for, next to the target model's engine."""
        return cls()

    @abstractmethod
    def propose(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        """At most ks[i] tokens for reqs[i] (fewer, or none, where it has no guess)."""

    def draft_probs(self, req: Req) -> list[torch.Tensor] | None:
        """The distributions [vocab] (float32, on the target's device) that req's latest proposals were
        drawn from, one per proposal, or None: the proposals are guesses, each kept exactly when the
        target's own draw equals it (the module docstring)."""
        return None

    def on_accept(self, req: Req, accepted: int) -> None:
        """The target kept the first `accepted` proposals of req's last verify step (a head that reads
        the target's hidden states keeps those of the accepted tokens here)."""

    def release(self, req: Req) -> None:
        """req holds nothing here any more (finished, aborted or retracted)."""

    def check_idle(self) -> str | None:
        """With no request left: what the proposer still holds that it should not, or None."""
        return None

    def shutdown(self) -> None:
        """Give back what the proposer holds (a draft model's engine)."""


class NgramProposer(Proposer):
    """Prompt lookup: find the latest n-gram of the request earlier in its tokens (longest n first, from
    `max_n` down to `min_n`) and propose the tokens that followed it there. An index per request maps each
    n-gram to where it last ended; it grows with the tokens, so a step costs O(new tokens), not O(length)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n

    @classmethod
    def create(cls, config: SchedulerConfig, target: Engine) -> Proposer:
        return cls(config.speculative_ngram_min, config.speculative_ngram_max)

    def propose(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        return [self._one(r, k) if k > 0 else [] for r, k in zip(reqs, ks)]

    def _one(self, req: Req, k: int) -> list[int]:
        toks = req.token_ids
        n_tok = len(toks)
        data = req.spec.proposer
        index: dict[tuple[int, ...], int] = data.setdefault("index", {})
        # index the n-grams ending before the last token: each has a following token to propose
        for end in range(data.get("upto", 0), n_tok):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                index[tuple(toks[end - n : end])] = end
        data["upto"] = n_tok
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            end = index.get(tuple(toks[n_tok - n :]))
            if end is None or end >= n_tok:
                continue
            # the continuation; past the known tokens it repeats the match's period (a loop continues)
            out: list[int] = []
            for i in range(k):
                j = end + i
                out.append(toks[j] if j < n_tok else out[j - n_tok])
            return out
        return []
