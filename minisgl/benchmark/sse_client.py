"""A lean HTTP/1.1 client for the online benchmarks' streamed requests: asyncio streams, kept-alive
connections, chunked transfer decoding and SSE `data:` lines, nothing else.

On a 2-core machine the client shares the cores with the server it measures: httpx's streaming path cost
~110 us of client CPU a streamed chunk there (5% of a core at 430 tok/s, taken from the server under
test), this one a fraction of that. `open_client` gives it for `http://` URLs and an httpx-based one with
the same interface for `https://`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit


class HTTPError(Exception):
    """A response other than 200: `status` and the start of its body."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:200]}")
        self.status = status


class _Conn:
    """One kept-alive connection and the bytes read past the last response."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.buf = bytearray()

    async def fill(self, timeout: float) -> None:
        data = await asyncio.wait_for(self.reader.read(1 << 16), timeout)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buf += data

    async def line(self, timeout: float) -> bytes:
        while (end := self.buf.find(b"\r\n")) < 0:
            await self.fill(timeout)
        out = bytes(self.buf[:end])
        del self.buf[: end + 2]
        return out

    async def exactly(self, n: int, timeout: float) -> bytes:
        while len(self.buf) < n:
            await self.fill(timeout)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def close(self) -> None:
        self.writer.close()


class SSEClient:
    """POSTs JSON and yields the SSE `data:` payloads of the streamed reply, as they arrive."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, timeout: float = 600.0) -> None:
        url = urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"the streaming client speaks plain http:// only, not {base_url!r}")
        self.host, self.port = url.hostname, url.port or 80
        self.prefix = url.path.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.head = (
            f"Host: {host}:{self.port}\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n"
        )
        self.head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.timeout = timeout
        self.idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        if self.idle:
            return self.idle.pop()
        reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), self.timeout)
        return _Conn(reader, writer)

    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        """POST `body` to prefix + path; yield each `data:` payload (stripped). HTTPError for a status
        other than 200. The connection goes back to the pool when the reply ends cleanly."""
        data = json.dumps(body).encode()
        req = f"POST {self.prefix}{path} HTTP/1.1\r\n{self.head}Content-Length: {len(data)}\r\n\r\n"
        conn, status, headers = await self._send(req.encode() + data)
        reusable = False
        try:
            chunked = headers.get("transfer-encoding", "").lower() == "chunked"
            length = int(headers["content-length"]) if "content-length" in headers else None
            if status != 200:
                raise HTTPError(status, (await self._body(conn, chunked, length)).decode(errors="replace"))
            pending = bytearray()  # SSE text not yet ended by a newline
            async for piece in self._pieces(conn, chunked, length):
                pending += piece
                if b"\n" not in piece:
                    continue
                *lines, rest = pending.split(b"\n")
                pending = bytearray(rest)
                for line in lines:
                    if line.startswith(b"data:"):
                        yield bytes(line[5:]).strip()
            reusable = headers.get("connection", "").lower() != "close" and (chunked or length is not None)
        finally:
            if reusable:
                self.idle.append(conn)
            else:
                conn.close()

    async def _send(self, request: bytes) -> tuple[_Conn, int, dict[str, str]]:
        """Send on a kept-alive connection, or on a new one if the server had closed it meanwhile (a server
        may close an idle connection at any time: the request is sent again once, on a fresh one)."""
        while True:
            reused = bool(self.idle)
            conn = await self._connect()
            try:
                conn.writer.write(request)
                status, headers = await self._head(conn)
                return conn, status, headers
            except (ConnectionError, asyncio.IncompleteReadError):
                conn.close()
                if not reused:
                    raise

    async def _head(self, conn: _Conn) -> tuple[int, dict[str, str]]:
        status_line = await conn.line(self.timeout)
        while not status_line:  # tolerate a stray CRLF between responses
            status_line = await conn.line(self.timeout)
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while line := await conn.line(self.timeout):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    async def _pieces(self, conn: _Conn, chunked: bool, length: int | None) -> AsyncIterator[bytes]:
        """The reply body as it arrives: chunked, Content-Length or until the server closes."""
        if chunked:
            while size := int((await conn.line(self.timeout)).split(b";")[0], 16):
                yield await conn.exactly(size, self.timeout)
                await conn.exactly(2, self.timeout)  # the CRLF after each chunk
            while await conn.line(self.timeout):  # trailers, up to the empty line
                pass
        elif length is not None:
            left = length
            while left:
                if not conn.buf:
                    await conn.fill(self.timeout)
                piece = bytes(conn.buf[:left])
                del conn.buf[: len(piece)]
                left -= len(piece)
                yield piece
        else:
            while True:
                if conn.buf:
                    yield bytes(conn.buf)
                    conn.buf.clear()
                try:
                    await conn.fill(self.timeout)
                except ConnectionError:
                    return

    async def _body(self, conn: _Conn, chunked: bool, length: int | None) -> bytes:
        return b"".join([piece async for piece in self._pieces(conn, chunked, length)])

    async def aclose(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


class HttpxSSEClient:
    """SSEClient's interface over httpx, for `https://` servers."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, timeout: float = 600.0) -> None:
        import httpx

        self.prefix = base_url.rstrip("/")
        self.http = httpx.AsyncClient(timeout=timeout, headers=headers)

    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        async with self.http.stream("POST", self.prefix + path, json=body) as r:
            if r.status_code != 200:
                raise HTTPError(r.status_code, (await r.aread()).decode(errors="replace"))
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    yield line[5:].strip().encode()

    async def aclose(self) -> None:
        await self.http.aclose()


def open_client(
    base_url: str, headers: dict[str, str] | None = None, timeout: float = 600.0
) -> SSEClient | HttpxSSEClient:
    """The lean client for http:// URLs, the httpx one otherwise."""
    if base_url.startswith("http://"):
        return SSEClient(base_url, headers, timeout)
    return HttpxSSEClient(base_url, headers, timeout)
