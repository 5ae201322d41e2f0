"""Typed message queues over ZMQ: PUSH/PULL between processes, PUB/SUB from TP rank 0 to the other ranks.

Each queue owns one socket; `encoder`/`decoder` turn objects into frames (the service passes
minisgl.message.dumps/loads). The side that is unique binds (`create=True`), the others connect; ZMQ lets
either start first. The service is the only user: the offline path never imports this module.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import zmq
import zmq.asyncio

T = TypeVar("T")
Encoder = Callable[[Any], bytes]
Decoder = Callable[[bytes], Any]


def _open(ctx: zmq.Context, kind: int, addr: str | list[str], create: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    # unbounded queues: a slow peer must never make the scheduler block (or drop) a message
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    # a message still queued for a peer that has gone must not make the process's exit wait for it (the
    # context's teardown blocks on lingering sockets: workers stopped by SIGTERM hung in it until killed)
    sock.setsockopt(zmq.LINGER, 0)
    if create:
        assert isinstance(addr, str), "a socket binds one address"
        sock.bind(addr)
    else:  # a PUSH connected to several PULLs sends to each in turn
        for a in [addr] if isinstance(addr, str) else addr:
            sock.connect(a)
    return sock


def _wait(sock: zmq.Socket, timeout: float | None) -> bool:
    """Whether a message is ready within `timeout` seconds (None: wait for one). A long wait still
    returns to Python every second: a process signal taken by another thread (ZMQ's, a tokenizer pool's)
    does not interrupt this one's poll, and its Python handler (the workers' SIGTERM) runs only then."""
    if timeout is not None and timeout <= 1.0:
        return bool(sock.poll(int(timeout * 1000)))
    deadline = None if timeout is None else time.monotonic() + timeout
    while not sock.poll(1000):
        if deadline is not None and time.monotonic() >= deadline:
            return False
    return True


class ZmqPushQueue(Generic[T]):
    """Send side of a PUSH/PULL pipe."""

    def __init__(self, addr: str | list[str], create: bool, encoder: Encoder) -> None:
        self.socket = _open(zmq.Context.instance(), zmq.PUSH, addr, create)
        self.encoder = encoder

    def put(self, obj: T) -> None:
        self.socket.send(self.encoder(obj), copy=False)

    def stop(self) -> None:
        self.socket.close(linger=0)


class ZmqPullQueue(Generic[T]):
    """Receive side of a PUSH/PULL pipe."""

    def __init__(self, addr: str, create: bool, decoder: Decoder) -> None:
        self.socket = _open(zmq.Context.instance(), zmq.PULL, addr, create)
        self.decoder = decoder

    def get(self, timeout: float | None = None) -> T | None:
        """Block until a message arrives (or `timeout` seconds pass: then None)."""
        if not _wait(self.socket, timeout):
            return None
        return self.decoder(self.socket.recv(copy=False).buffer)

    def get_all(self) -> list[T]:
        """Every message already waiting, without blocking."""
        out: list[T] = []
        while True:
            try:
                frame = self.socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            out.append(self.decoder(frame.buffer))

    def stop(self) -> None:
        self.socket.close(linger=0)


class ZmqAsyncPushQueue(Generic[T]):
    """PUSH for an asyncio program (the API server)."""

    def __init__(self, addr: str | list[str], create: bool, encoder: Encoder) -> None:
        self.socket = _open(zmq.asyncio.Context.instance(), zmq.PUSH, addr, create)
        self.encoder = encoder

    async def put(self, obj: T) -> None:
        await self.socket.send(self.encoder(obj), copy=False)

    def put_nowait(self, obj: T) -> None:
        """Send without awaiting (usable in `finally` of a cancelled coroutine); the queue is unbounded."""
        self.socket.send(self.encoder(obj), zmq.NOBLOCK, copy=False)

    def stop(self) -> None:
        self.socket.close(linger=0)


class ZmqAsyncPullQueue(Generic[T]):
    """PULL for an asyncio program."""

    def __init__(self, addr: str, create: bool, decoder: Decoder) -> None:
        self.socket = _open(zmq.asyncio.Context.instance(), zmq.PULL, addr, create)
        self.decoder = decoder

    async def get(self) -> T:
        frame = await self.socket.recv(copy=False)
        return self.decoder(frame.buffer)

    def stop(self) -> None:
        self.socket.close(linger=0)


class ZmqPubQueue(Generic[T]):
    """Rank 0's fan-out to the other ranks. PUB silently drops messages for subscribers that have not
    joined yet, so `wait_for_subscribers` (an XPUB socket reports each subscription) must return first."""

    def __init__(self, addr: str, encoder: Encoder) -> None:
        self.socket = _open(zmq.Context.instance(), zmq.XPUB, addr, create=True)
        self.socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscriber, not only the first per topic
        self.encoder = encoder

    def bind_tcp(self) -> int:
        """Also listen on a free TCP port of every interface (for the ranks of other nodes); returns it."""
        return self.socket.bind_to_random_port("tcp://*")

    def wait_for_subscribers(self, n: int, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        joined = 0
        while joined < n:
            left = deadline - time.monotonic()
            if left <= 0 or not self.socket.poll(int(left * 1000)):
                raise TimeoutError(f"only {joined} of {n} subscribers joined within {timeout:.0f} s")
            if self.socket.recv()[:1] == b"\x01":  # \x01 + topic: subscribe; \x00: unsubscribe
                joined += 1

    def put(self, obj: T) -> None:
        self.socket.send(self.encoder(obj), copy=False)

    def stop(self, linger: float = 0.0) -> None:
        """Close; `linger` seconds let the last message reach subscribers over TCP."""
        self.socket.close(linger=int(linger * 1000))


class ZmqSubQueue(Generic[T]):
    """A non-zero rank's receive side of rank 0's fan-out (subscribed to everything)."""

    def __init__(self, addr: str, decoder: Decoder) -> None:
        self.socket = _open(zmq.Context.instance(), zmq.SUB, addr, create=False)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.decoder = decoder

    def get(self, timeout: float | None = None) -> T | None:
        if not _wait(self.socket, timeout):
            return None
        return self.decoder(self.socket.recv(copy=False).buffer)

    def stop(self) -> None:
        self.socket.close(linger=0)
