"""Retraction: the KV pages of a decode step, when the pool may be out of them.

Every running request needs a page when its next position starts one. When the pool cannot give them,
the step in flight is processed first (requests it finishes free their pages, and the host state becomes
exact); after that the newest request goes back to the front of the queue, keeping its tokens, until the
others fit. Its computed KV goes to the prefix cache, so resuming recomputes only what was evicted
meanwhile."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from minisgl.core import Req
from minisgl.utils import init_logger

if TYPE_CHECKING:
    from .cache import CacheManager
    from .decode import DecodeManager
    from .prefill import PrefillManager

logger = init_logger(__name__)


class Retraction:
    def __init__(
        self,
        cache: CacheManager,
        decode: DecodeManager,
        prefill: PrefillManager,
        release: Callable[[Req], None],
    ) -> None:
        self.cache, self.decode, self.prefill = cache, decode, prefill
        self._release = release  # gives back a request's slot and pages
        self.num_retractions = 0

    def give_pages(self, reqs: list[Req], drain: Callable[[], bool]) -> list[Req]:
        """The decodable requests, each with the page of its next position; `drain` processes the step in
        flight (False when there was none). Empty when every request was retracted or finished."""
        ps = self.cache.page_size
        while True:
            short = [r for r in reqs if r.cached_len // ps >= len(r.pages)]
            pages = self.cache.alloc(len(short))
            if pages is not None:
                for r, p in zip(short, pages):
                    r.pages.append(p)
                return reqs
            if not drain():
                self.retract(self.decode.newest(reqs))
            reqs = self.decode.decodable()
            if not reqs:
                return reqs

    def retract(self, req: Req) -> None:
        """Send a running request back to the front of the queue, keeping its tokens."""
        logger.warning(
            f"KV pool full: retracting request {req.uid} ({len(req.token_ids)} tokens) to the queue"
        )
        self.num_retractions += 1
        self.decode.remove(req)
        self._release(req)
        req.cached_len = req.device_len = req.table_len = 0
        self.prefill.add(req, front=True)
