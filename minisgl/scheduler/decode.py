"""DecodeManager: the running set (retraction.py gives its requests their pages, retracting when the pool is short)."""

from __future__ import annotations

from minisgl.core import Req


class DecodeManager:
    def __init__(self) -> None:
        self.running: list[Req] = []

    def add(self, req: Req) -> None:
        self.running.append(req)

    def remove(self, req: Req) -> None:
        self.running.remove(req)

    def decodable(self) -> list[Req]:
        """Requests whose next token is worth computing (the last one may still be in flight)."""
        return [
            r
            for r in self.running
            if not r.finished and r.device_len < r.max_total_len and r.device_len == r.cached_len + 1
        ]

    def newest(self, candidates: list[Req]) -> Req:
        return max(candidates, key=lambda r: r.arrival)
