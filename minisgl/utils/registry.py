"""Name -> class registry: `--attn triton` or `--cache radix` pick an implementation by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named table of implementations of one interface."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._table: dict[str, T] = {}

    def register(self, *names: str) -> Callable[[T], T]:
        def wrap(obj: T) -> T:
            for name in names:
                assert name not in self._table, f"{self.kind} {name!r} registered twice"
                self._table[name] = obj
            return obj

        return wrap

    def get(self, name: str) -> T:
        self.check(name)
        return self._table[name]

    def check(self, name: str) -> None:
        """Raise ValueError naming the known names if `name` is not one; builds nothing."""
        if name not in self._table:
            raise ValueError(f"unknown {self.kind} {name!r}; supported: {', '.join(self.names())}")

    def names(self) -> list[str]:
        return sorted(self._table)

    def __contains__(self, name: str) -> bool:
        return name in self._table
