"""The API server's side of ZMQ: requests out, and every reply routed by uid to the request that owns it.

Each HTTP request gets one uid per choice (prompt x n); a single background task routes every reply from the
detokenizer to the asyncio.Queue of the request that owns the uid. A client that goes away gets its
unfinished uids aborted, which frees their slots and KV.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from minisgl.message import (
    AbortMsg,
    BatchFrontendMsg,
    FlushCacheMsg,
    StatsMsg,
    TokenizeMsg,
    TokenLogprob,
    UserReply,
    dumps,
    loads,
)
from minisgl.utils import init_logger

from ..args import ServerArgs
from ..zmq_queue import ZmqAsyncPullQueue, ZmqAsyncPushQueue
from .errors import ClientGone, overloaded
from .metrics import Metrics

logger = init_logger(__name__, "api")

DISCONNECT_POLL = 0.5  # seconds between checks that a non-streaming client is still there


class FrontendManager:
    """The API server's side of ZMQ: sends TokenizeMsg/AbortMsg, routes each UserReply to its request."""

    def __init__(self, args: ServerArgs) -> None:
        # with N tokenizers this socket binds and spreads requests over them; otherwise it connects to the worker
        self.send: ZmqAsyncPushQueue[Any] = ZmqAsyncPushQueue(
            args.request_addr, create=args.num_tokenizer > 0, encoder=dumps
        )
        self.recv: ZmqAsyncPullQueue[Any] = ZmqAsyncPullQueue(args.frontend_addr, create=True, decoder=loads)
        self.args = args
        self.uids = itertools.count()
        self.queues: dict[int, asyncio.Queue[UserReply]] = {}
        self.metrics = Metrics(args.page_size)
        self.stats: dict[str, float] = {}
        self._listener: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start routing replies (needs the running event loop)."""
        self._listener = asyncio.create_task(self._listen())

    async def _listen(self) -> None:
        while True:
            msg = await self.recv.get()
            if isinstance(msg, StatsMsg):
                self.stats = msg.stats
                self.metrics.update(msg.stats)
                continue
            assert isinstance(msg, BatchFrontendMsg), type(msg).__name__
            for reply in msg.replies:
                queue = self.queues.get(reply.uid)
                if queue is not None:  # else: finished or aborted already
                    queue.put_nowait(reply)

    def register(self, queue: asyncio.Queue[UserReply]) -> int:
        uid = next(self.uids)
        self.queues[uid] = queue
        return uid

    def unregister(self, uid: int) -> None:
        self.queues.pop(uid, None)

    async def submit(self, msgs: list[TokenizeMsg]) -> None:
        for msg in msgs:
            await self.send.put(msg)

    def abort(self, uids: set[int]) -> None:
        """Stop these requests; safe to call from the `finally` of a cancelled coroutine."""
        order = sorted(uids)
        if not order:
            return
        more = f" and {len(order) - 1} more sequences of its request" if len(order) > 1 else ""
        logger.warning(f"Aborting request {order[0]}{more}")  # one line per HTTP request, not per sequence
        for uid in order:
            self.send.put_nowait(AbortMsg(uid))

    def flush_cache(self) -> None:
        """Ask the scheduler to empty its prefix cache (it refuses while requests run or wait)."""
        self.send.put_nowait(FlushCacheMsg())

    def check_capacity(self, new: int) -> None:
        """Raise HTTP 429 when `new` more sequences would leave more than --max-waiting-requests waiting
        beyond the --max-running-req that can run (every uid in flight counts until it finishes)."""
        waiting = len(self.queues) + new - self.args.max_running_req
        if waiting > self.args.max_waiting_requests:
            raise overloaded(waiting, self.args.max_waiting_requests)

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
        self.send.stop()
        self.recv.stop()


@dataclass
class ChoiceState:
    """What one choice (one uid) has produced so far."""

    index: int
    uid: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, those whose KV the prefix cache held at admission
    completion_tokens: int = 0
    first_token: float | None = None
    last_token: float | None = None


class Generation:
    """One HTTP request's choices in flight: submit them, iterate their replies, abort what is left."""

    def __init__(self, frontend: FrontendManager, prompt_index: list[int]) -> None:
        self.frontend = frontend
        self.metrics = frontend.metrics
        self.queue: asyncio.Queue[UserReply] = asyncio.Queue()
        self.choices = [ChoiceState(i, frontend.register(self.queue), p) for i, p in enumerate(prompt_index)]
        self.by_uid = {c.uid: c for c in self.choices}
        self.unfinished = set(self.by_uid)
        self.start = time.perf_counter()
        self.checked = time.monotonic()

    @property
    def done(self) -> bool:
        return not self.unfinished

    async def next(self, request: Request | None = None) -> tuple[ChoiceState, UserReply]:
        """The next reply of any choice. With `request`, checks for a disconnect every half second
        (a non-streaming handler is not cancelled when its client goes away)."""
        while True:
            if request is None:
                reply = await self.queue.get()
            else:
                if time.monotonic() - self.checked > DISCONNECT_POLL:
                    self.checked = time.monotonic()
                    if await request.is_disconnected():
                        raise ClientGone
                try:
                    reply = await asyncio.wait_for(self.queue.get(), timeout=DISCONNECT_POLL)
                except asyncio.TimeoutError:
                    continue
            choice = self.by_uid[reply.uid]
            self._apply(choice, reply)
            return choice, reply

    def _apply(self, c: ChoiceState, reply: UserReply) -> None:
        now = time.perf_counter()
        if reply.token_ids:
            if c.first_token is None:
                c.first_token = now
                self.metrics.ttft.observe(now - self.start)
            else:
                self.metrics.itl.observe((now - (c.last_token or now)) / len(reply.token_ids))
            c.last_token = now
            self.metrics.generation_tokens.inc(len(reply.token_ids))
        c.text += reply.text
        c.token_ids += reply.token_ids
        c.logprobs += reply.logprobs or []
        c.prompt_tokens = reply.prompt_tokens or c.prompt_tokens
        c.cached_tokens = reply.cached_tokens or c.cached_tokens
        c.completion_tokens = reply.completion_tokens or c.completion_tokens
        if reply.finished:
            self.unfinished.discard(c.uid)
            self.frontend.unregister(c.uid)
            c.finish_reason = reply.finish_reason
            if reply.error is None:
                self.metrics.finished.labels(reply.finish_reason or "unknown").inc()
                self.metrics.prompt_tokens.inc(c.prompt_tokens)
                self.metrics.e2e.observe(now - self.start)

    def usage(self) -> dict[str, Any]:
        """OpenAI's `usage`, with `prompt_tokens_details.cached_tokens` from the prefix cache."""
        prompts: dict[int, int] = {}
        cached: dict[int, int] = {}
        for c in self.choices:  # n choices of one prompt count its tokens once, as OpenAI does
            prompts[c.prompt_index] = c.prompt_tokens
            # the choice admitted first computed the prompt, the others found it cached: count the first
            cached[c.prompt_index] = min(cached.get(c.prompt_index, c.cached_tokens), c.cached_tokens)
        prompt = sum(prompts.values())
        completion = sum(c.completion_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
        }

    def close(self) -> None:
        """Abort every choice still generating (the client is gone or the request failed)."""
        for c in self.choices:
            self.frontend.unregister(c.uid)
        if self.unfinished:
            self.frontend.abort(self.unfinished)
            self.unfinished.clear()
