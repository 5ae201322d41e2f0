"""CacheManager: the free KV pages and the prefix cache that holds the rest.

Every page is in exactly one place: the free list, the prefix cache, or a request's private pages
(`Req.pages` minus the pages its locked cache prefix holds)."""

from __future__ import annotations

import numpy as np
import torch

from minisgl.core import Req
from minisgl.kvcache import PREFIX_CACHES, BasePrefixCache


class CacheManager:
    def __init__(self, num_pages: int, page_size: int, cache_type: str) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self.cache: BasePrefixCache = PREFIX_CACHES.get(cache_type)(page_size)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))

    # ---- pages -----------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Pages a request could get now: free plus evictable."""
        return len(self._free) + self.cache.evictable_pages

    def alloc(self, n: int) -> list[int] | None:
        """n pages, evicting cached prefixes if needed; None (and nothing taken) when impossible."""
        if n > len(self._free):
            self._free.extend(self.cache.evict(n - len(self._free)))
        if n > len(self._free):
            return None
        out = self._free[-n:] if n else []
        del self._free[len(self._free) - n :]
        return out

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)

    def slots_of(self, pages: list[int], n: int) -> torch.Tensor:
        """KV slots of positions 0..n-1 of a request owning `pages`."""
        ps = self.page_size
        t = torch.from_numpy(np.asarray(pages[: (n + ps - 1) // ps], dtype=np.int32))
        if ps == 1:
            return t
        return (t[:, None] * ps + torch.arange(ps, dtype=torch.int32)[None, :]).flatten()[:n]

    # ---- prefix cache ----------------------------------------------------------------------------
    def flush(self) -> int:
        """Evict every unlocked cached prefix; returns the pages freed."""
        pages = self.cache.evict(self.cache.evictable_pages)
        self._free.extend(pages)
        return len(pages)

    def match(self, req: Req) -> int:
        """Lock the longest cached prefix of req's tokens (keeping at least one token to compute, and every
        position whose logits give a prompt log-probability) and take its pages as req's first pages (an embedding
        that pools every position, none);
        returns the cached length."""
        ps = self.page_size
        rows = req.prompt_lp_rows
        first = min(len(req.token_ids) - 1, rows.start if rows else len(req.token_ids), req.embed_from)
        limit = first // ps * ps
        result = self.cache.match_prefix(req.token_ids[:limit])
        self.cache.lock(result.handle)
        req.cache_handle, req.prefix_cache_len = result.handle, result.length
        req.pages = (result.slots[::ps] // ps).tolist()
        return result.length

    def insert(self, req: Req, length: int) -> None:
        """Hand the page-aligned part of req's first `length` tokens to the cache; req keeps a lock."""
        ps = self.page_size
        aligned = min(length, len(req.token_ids)) // ps * ps
        if aligned <= req.prefix_cache_len:
            return
        handle, _ = self.cache.insert(req.token_ids[:aligned], self.slots_of(req.pages, aligned))
        if handle is None:  # a cache that keeps nothing
            return
        self.cache.lock(handle)
        self.cache.unlock(req.cache_handle)
        req.cache_handle, req.prefix_cache_len = handle, aligned

    def release(self, req: Req, keep: bool = True) -> None:
        """The request is done with its KV: cache what it computed (when `keep`), free the rest."""
        held: set = set()
        if keep:
            self.insert(req, req.cached_len)
        if req.prefix_cache_len:
            ps = self.page_size
            _, slots = self.cache.insert(
                req.token_ids[: req.prefix_cache_len], self.slots_of(req.pages, req.prefix_cache_len)
            )
            held = set((slots[::ps] // ps).tolist())
        self.cache.unlock(req.cache_handle)
        self.free([p for p in req.pages if p not in held])
        req.pages, req.cache_handle, req.prefix_cache_len = [], None, 0

    # ---- checks ----------------------------------------------------------------------------------
    def check_integrity(self, full: bool = True) -> str | None:
        """None when every page is free or held by the cache and nothing is locked; else what is wrong.
        The counts only (O(1)) unless `full`: then also that no page is held twice, which walks every page
        (some 100 ms for a GPU's million one-token pages: the service does it only when asked to)."""
        free, cached_pages = len(self._free), self.cache.cached_pages
        if free + cached_pages != self.num_pages:
            return f"page leak: {free} free + {cached_pages} cached != {self.num_pages} total"
        if self.cache.evictable_pages != cached_pages:
            return "a cached prefix is still locked while no request runs"
        if not full:
            return None
        cached = self.cache.all_pages()
        seen = self._free + cached
        if len(seen) != self.num_pages or len(set(seen)) != self.num_pages:
            return (
                f"page leak: {len(self._free)} free + {len(cached)} cached != {self.num_pages} total "
                f"({len(set(seen))} distinct)"
            )
        if self.cache.has_locks():
            return "a cached prefix is still locked while no request runs"
        return None
