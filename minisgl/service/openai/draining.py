"""A graceful stop: on SIGTERM the server admits nothing new (HTTP 503), lets the running requests finish
for up to `--shutdown-timeout` seconds, then ends those still running as a client would see an abort: a
final chunk with `finish_reason: "abort"` and `data: [DONE]` for a stream, the text so far for a plain
request. Only then does uvicorn close the connections (service/launch.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from minisgl.utils import init_logger

from .errors import error_response

logger = init_logger(__name__, "api")

RETRY_AFTER_S = 5  # what a client refused while the server stops is asked to wait (another replica)
WRITE_GRACE_S = 2.0  # after the last request ended: time for its final chunks to reach the client


class Drain:
    """The stopping state of one server, and the middleware that refuses new requests meanwhile."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.draining = False

    async def run(self, running: Callable[[], int], end_all: Callable[[], None]) -> None:
        """Stop admitting, wait for the `running()` requests to finish (at most `timeout` seconds), end
        the rest (`end_all`), and return once their last replies are written."""
        self.draining = True
        left = running()
        logger.info(f"Stopping: no new requests; waiting up to {self.timeout:g} s for {left} running")
        deadline = time.monotonic() + self.timeout
        while running() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if running():
            logger.info(f"Ending {running()} requests still running after {self.timeout:g} s")
            end_all()
        deadline = time.monotonic() + WRITE_GRACE_S
        while running() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # the streams' last frames are written after their final reply


class DrainMiddleware:
    """Answers 503 (OpenAI's error object, `Retry-After`) to every request that arrives while stopping."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.drain.draining:
            await self.app(scope, receive, send)
            return
        response = error_response(
            503,
            "the server is shutting down and accepts no new requests",
            "server_shutting_down",
            kind="server_error",
            headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"},
        )
        await response(scope, receive, send)
