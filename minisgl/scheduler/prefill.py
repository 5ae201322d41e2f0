"""PrefillManager: the waiting queue and admission (the prefill adder).

A request is admitted when a request slot is free and the pool can hold its uncached tokens plus the
room reserved for the tokens it may still decode. One step computes at most `max_prefill_length` prompt
tokens; a longer prompt is split into chunks over several steps (one chunked request at a time)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minisgl.core import Req

if TYPE_CHECKING:
    from .cache import CacheManager
    from .table import TableManager


def pages_for(tokens: int, page_size: int) -> int:
    return (tokens + page_size - 1) // page_size


@dataclass
class PrefillPlan:
    reqs: list[Req]
    prefix_lens: list[int]
    extend_lens: list[int]


class PrefillManager:
    def __init__(
        self, cache: CacheManager, table: TableManager, max_prefill_length: int, reserve_ratio: float
    ) -> None:
        self.cache, self.table = cache, table
        self.budget = max_prefill_length
        self.reserve_ratio = reserve_ratio
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None  # admitted, prompt partly computed
        self.stats = {"prompt_tokens": 0, "cached_prompt_tokens": 0, "computed_prompt_tokens": 0}
        self._arrivals = 0

    def add(self, req: Req, front: bool = False) -> None:
        (self.waiting.appendleft if front else self.waiting.append)(req)

    def remove(self, uid: int) -> Req | None:
        for req in self.waiting:
            if req.uid == uid:
                self.waiting.remove(req)
                return req
        return None

    def _future_pages(self, req: Req) -> int:
        """Pages req may still need for decoding, scaled by the reserve ratio."""
        need = pages_for(req.max_total_len, self.cache.page_size) - pages_for(
            len(req.token_ids), self.cache.page_size
        )
        return int(need * self.reserve_ratio + 0.999)

    def reserved_pages(self, running: list[Req]) -> int:
        ps = self.cache.page_size
        total = 0
        for r in running:
            if not r.finished:
                need = pages_for(r.max_total_len, ps) - len(r.pages)
                total += int(max(0, need) * self.reserve_ratio + 0.999)
        return total

    def _grow(self, req: Req, upto: int) -> bool:
        """Give req pages for positions < upto."""
        need = pages_for(upto, self.cache.page_size) - len(req.pages)
        if need <= 0:
            return True
        pages = self.cache.alloc(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def schedule(self, running: list[Req], cap: int | None = None) -> PrefillPlan | None:
        """Pick this step's prefill work: the chunked request first, then waiting requests in order
        (`cap`: a smaller token budget for this step)."""
        plan = PrefillPlan([], [], [])
        budget = self.budget if cap is None else min(cap, self.budget)
        reserved = self.reserved_pages(running)
        if self.chunked is not None:
            req = self.chunked
            n = min(budget, len(req.token_ids) - req.cached_len)
            if self._grow(req, req.cached_len + n):
                self._take(plan, req, n)
                budget -= n
        while self.waiting and budget > 0 and self.chunked is None and self.table.num_free > 0:
            req = self.waiting[0]
            cached = self.cache.match(req)
            uncached = len(req.token_ids) - cached
            now_pages = pages_for(len(req.token_ids), self.cache.page_size) - len(req.pages)
            if self.cache.num_available - reserved < now_pages + self._future_pages(req):
                self.cache.release(req)  # undo the match; try again next step
                break
            self.waiting.popleft()
            n = min(budget, uncached)
            ok = self._grow(req, cached + n)
            assert ok, "admission checked the pages"
            req.table_idx = self.table.alloc()
            req.cached_len = req.device_len = cached
            if req.arrival == 0:  # first admission (not a resumed retraction)
                req.cached_prompt_len = min(cached, req.prompt_len)
                self.stats["prompt_tokens"] += req.prompt_len
                self.stats["cached_prompt_tokens"] += req.cached_prompt_len
            self._arrivals += 1
            req.arrival = self._arrivals
            reserved += self._future_pages(req)
            self._take(plan, req, n)
            budget -= n
        return plan if plan.reqs else None

    def _take(self, plan: PrefillPlan, req: Req, n: int) -> None:
        plan.reqs.append(req)
        plan.prefix_lens.append(req.cached_len)
        plan.extend_lens.append(n)
        self.stats["computed_prompt_tokens"] += n
        # cached at once: a later request of this same batch shares it (the backend stores every new
        # K/V of the batch before any attention reads them)
        self.cache.insert(req, req.cached_len + n)
        self.chunked = req if req.cached_len + n < len(req.token_ids) else None
