"""uvicorn's HTTP/1.1 protocol with a deadline for a request's headers.

uvicorn times out an idle keep-alive connection, but not one that opened (or began its next request) and
never finished sending its headers: such connections would be held forever. The request body has its own
deadline in the app (`--request-timeout`, HTTP 408)."""

from __future__ import annotations

import asyncio
from typing import Any

try:  # httptools parses requests and frames chunks in C (h11 in Python): a third less CPU a streamed token
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Protocol
except ImportError:  # pragma: no cover - httptools comes with the service's dependencies
    from uvicorn.protocols.http.h11_impl import H11Protocol as _Protocol


class HeaderDeadlineProtocol(_Protocol):
    """Closes a connection whose next request's headers are not complete `header_timeout` seconds after it
    opened or after its last response."""

    header_timeout = 30.0

    @classmethod
    def with_timeout(cls, seconds: float) -> type[HeaderDeadlineProtocol]:
        """This protocol with another deadline (uvicorn takes a class and builds one per connection)."""
        return type(cls.__name__, (cls,), {"header_timeout": seconds})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def _arm(self) -> None:
        waiting_for = self.cycle  # a new request replaces it as soon as its headers are complete
        self.loop.call_later(self.header_timeout, self._expire, waiting_for)

    def _expire(self, waiting_for: Any) -> None:
        idle = self.cycle is None or self.cycle.response_complete
        if self.cycle is waiting_for and idle and not self.transport.is_closing():
            self.transport.close()
