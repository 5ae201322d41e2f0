"""The online benchmark's lean streaming client against a real socket server that answers with hand-written
HTTP/1.1 responses: chunked (events split across chunks), Content-Length and close-delimited bodies, an
error status, a kept-alive connection used for the next request, and one the server closed while idle."""

from __future__ import annotations

import asyncio
import json

import pytest

from minisgl.benchmark.sse_client import HTTPError, SSEClient

EVENTS = [b'{"a": 1}', b'{"b": "x y"}', b"[DONE]"]
BODY = b"".join(b"data: " + e + b"\n\n" for e in EVENTS) + b": a comment line\n\n"


def _chunked(body: bytes, sizes: list[int]) -> bytes:
    out, i = b"", 0
    for n in sizes:
        out += f"{n:x}\r\n".encode() + body[i : i + n] + b"\r\n"
        i += n
    rest = body[i:]
    if rest:
        out += f"{len(rest):x};ext=1\r\n".encode() + rest + b"\r\n"
    return out + b"0\r\n\r\n"


RESPONSES = {
    "/chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunked(BODY, [3, 7, 1, 20]),
    "/length": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY,
    "/close": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + BODY,
    # kept alive as far as the client knows, then closed by the server while idle
    "/silent": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY,
    "/error": b'HTTP/1.1 400 Bad Request\r\nContent-Length: 17\r\n\r\n{"error": "nope"}',
}


async def _serve() -> tuple[asyncio.Server, int, list[dict]]:
    seen: list[dict] = []  # one entry a request: its connection's number, path and JSON body

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = max([s["conn"] for s in seen], default=0) + 1
        while True:
            head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
            if not head:
                break
            lines = head.decode().split("\r\n")
            path = lines[0].split()[1]
            length = next(int(x.split(":")[1]) for x in lines if x.lower().startswith("content-length"))
            body = json.loads(await reader.readexactly(length))
            seen.append({"conn": conn, "path": path, "body": body})
            writer.write(RESPONSES[path.removeprefix("/v1")])
            await writer.drain()
            if path.endswith(("/close", "/silent")):
                break
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


async def _collect(client: SSEClient, path: str) -> list[bytes]:
    return [p async for p in client.stream(path, {"q": path})]


def test_the_client_reads_every_framing_and_reuses_kept_alive_connections():
    async def main():
        server, port, seen = await _serve()
        client = SSEClient(f"http://127.0.0.1:{port}/v1", {"Authorization": "Bearer k"}, timeout=10)
        assert await _collect(client, "/chunked") == EVENTS
        assert await _collect(client, "/length") == EVENTS
        assert await _collect(client, "/chunked") == EVENTS
        assert await _collect(client, "/close") == EVENTS
        assert await _collect(client, "/chunked") == EVENTS
        assert await _collect(client, "/silent") == EVENTS
        await asyncio.sleep(0.1)  # the server has closed the idle connection by now
        assert await _collect(client, "/length") == EVENTS  # sent again on a fresh connection
        with pytest.raises(HTTPError) as e:
            await _collect(client, "/error")
        await client.aclose()
        server.close()
        return seen, e.value

    seen, err = asyncio.run(main())
    paths = ["/chunked", "/length", "/chunked", "/close", "/chunked", "/silent", "/length", "/error"]
    assert [s["path"] for s in seen] == ["/v1" + p for p in paths]
    assert [s["body"]["q"] for s in seen] == paths
    # the first four on one kept-alive connection; the server closed it after /close, so a new one, and
    # after /silent (the client learns it only when it sends the next request there) a third
    assert [s["conn"] for s in seen] == [1, 1, 1, 1, 2, 2, 3, 3]
    assert err.status == 400 and "nope" in str(err)


def test_the_client_refuses_other_schemes():
    with pytest.raises(ValueError, match="http://"):
        SSEClient("ftp://127.0.0.1:1/v1")
