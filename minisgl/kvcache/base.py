"""The prefix-cache interface: token sequences -> KV slots, with reference-counted locks."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class MatchResult:
    handle: Any  # lock/unlock this while the request uses the prefix
    length: int  # cached tokens (a multiple of page_size)
    slots: torch.Tensor  # [length] int32 KV slots of those tokens (host)


class BasePrefixCache(ABC):
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size

    @abstractmethod
    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        """The longest cached page-aligned prefix of `token_ids`."""

    @abstractmethod
    def insert(self, token_ids: list[int], slots: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """Insert a page-aligned prefix; returns (handle of its last node, the slots the cache now holds
        for it). Where a prefix was already cached, the cache keeps its own slots: the caller's
        differing slots stay the caller's to free."""

    @abstractmethod
    def lock(self, handle: Any) -> None: ...

    @abstractmethod
    def unlock(self, handle: Any) -> None: ...

    @abstractmethod
    def evict(self, num_pages: int) -> list[int]:
        """Drop least-recently-used unlocked entries; return the freed page ids (>= num_pages if possible)."""

    @property
    @abstractmethod
    def evictable_pages(self) -> int: ...

    @property
    @abstractmethod
    def cached_pages(self) -> int: ...

    def all_pages(self) -> list[int]:
        """Every page the cache holds (for the integrity check)."""
        return []

    def has_locks(self) -> bool:
        return False
