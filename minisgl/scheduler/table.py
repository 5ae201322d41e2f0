"""TableManager: the request slots, i.e. rows of the page table and the token pool."""

from __future__ import annotations


class TableManager:
    def __init__(self, max_running_req: int) -> None:
        self.capacity = max_running_req
        self._free: list[int] = list(range(max_running_req - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        assert self._free, "no free request slot (admission should have checked)"
        return self._free.pop()

    def free(self, row: int) -> None:
        assert 0 <= row < self.capacity and row not in self._free, f"bad free of row {row}"
        self._free.append(row)
