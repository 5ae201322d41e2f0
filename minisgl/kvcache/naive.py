"""The naive cache: caches nothing. Each request computes its whole prompt and frees its own KV."""

from __future__ import annotations

from typing import Any

import torch

from .base import BasePrefixCache, MatchResult

_EMPTY = torch.empty(0, dtype=torch.int32)


class NaivePrefixCache(BasePrefixCache):
    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        return MatchResult(None, 0, _EMPTY)

    def insert(self, token_ids: list[int], slots: torch.Tensor) -> tuple[Any, torch.Tensor]:
        return None, _EMPTY

    def lock(self, handle: Any) -> None:
        pass

    def unlock(self, handle: Any) -> None:
        pass

    def evict(self, num_pages: int) -> list[int]:
        return []

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def cached_pages(self) -> int:
        return 0
