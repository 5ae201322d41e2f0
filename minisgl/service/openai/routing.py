"""The API server's side of ZMQ: requests out, and every reply routed by uid to the request that owns it.

Each HTTP request gets one uid per choice (prompt x n); a single background task routes every row of each
ReplyBatch from the detokenizer to the Generation that owns the uid, whose handler takes everything that
arrived since it last looked in one go (a stream writes it as one chunk). A client that goes away gets its
unfinished uids aborted, which frees their slots and KV.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from minisgl.core import FinishReason, PromptLogprobs
from minisgl.message import (
    AbortMsg,
    FlushCacheMsg,
    ReplyBatch,
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

    def __init__(self, args: ServerArgs, index: int = 0) -> None:
        # connected to every tokenizer (ZMQ sends to each in turn), or to the one worker that does both
        self.send: ZmqAsyncPushQueue[Any] = ZmqAsyncPushQueue(args.request_addrs, create=False, encoder=dumps)
        self.recv: ZmqAsyncPullQueue[Any] = ZmqAsyncPullQueue(
            args.frontend_addrs[index], create=True, decoder=loads
        )
        self.args = args
        # API server `index` of --api-server-count K: its uids are index, index + K, ... (the detokenizer
        # sends each reply to the server of its uid modulo K)
        self.uids = itertools.count(index, args.api_server_count)
        self.queues: dict[int, Generation] = {}  # uid -> the request it belongs to
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
            assert isinstance(msg, ReplyBatch), type(msg).__name__
            queues, info, texts, ids = self.queues, msg.info, msg.texts, msg.token_ids
            for i, uid in enumerate(msg.uids):  # the columns as they are: no object per plain row
                gen = queues.get(uid)
                if gen is not None:  # else: finished or aborted already
                    gen.push(uid, texts[i], ids[i], info.get(i))

    def register(self, gen: Generation) -> int:
        uid = next(self.uids)
        self.queues[uid] = gen
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

    def end_all(self) -> None:
        """End every request still running (the server stops): each gets a final reply, finish reason
        "abort", and the scheduler an abort."""
        for uid, gen in list(self.queues.items()):
            last = gen.unread.get(uid)
            if last is None or not last.finished:  # (else its end is there, not yet taken)
                gen.push(uid, "", [], {"finished": True, "finish_reason": FinishReason.ABORT.value})
        self.abort(set(self.queues))

    def flush_cache(self) -> None:
        """Ask the scheduler to empty its prefix cache (it refuses while requests run or wait)."""
        self.send.put_nowait(FlushCacheMsg())

    def check_capacity(self, new: int) -> None:
        """Raise HTTP 429 when `new` more sequences would leave more than --max-waiting-requests waiting
        beyond the --max-running-req that can run (every uid in flight counts until it finishes). With K
        API servers each admits its K-th share of both (each sees only its own requests)."""
        k = self.args.api_server_count
        limit = -(-self.args.max_waiting_requests // k)
        waiting = len(self.queues) + new - -(-self.args.max_running_req // k)
        if waiting > limit:
            raise overloaded(waiting, limit)

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
        self.send.stop()
        self.recv.stop()


def _join(reply: UserReply, info: dict[str, Any]) -> None:
    """Add a later reply's other fields (a ReplyBatch row's info) to the reply it joins."""
    for key, value in info.items():
        if key == "logprobs":
            reply.logprobs = (reply.logprobs or []) + value
        elif key == "extras":
            reply.extras = {**(reply.extras or {}), **value}
        else:  # the later value wins: finished, finish_reason, the usage counts, an error
            setattr(reply, key, value)


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
    prompt_logprobs: PromptLogprobs | None = None  # asked for (SamplingParams.prompt_logprobs)
    embedding: list[float] | None = None  # an embedding request's vector


class Generation:
    """One HTTP request's choices in flight: submit them, iterate their replies, abort what is left."""

    def __init__(self, frontend: FrontendManager, prompt_index: list[int]) -> None:
        self.frontend = frontend
        self.metrics = frontend.metrics
        self.inbox: deque[UserReply] = deque()  # replies routed here, not yet taken
        self.unread: dict[int, UserReply] = {}  # uid -> its reply in the inbox, which later text joins
        self.waiter: asyncio.Future[None] | None = None  # the handler waiting for a reply (a bare future:
        # an asyncio.Event costs a new future and a loop lookup on every wait, once per token and stream)
        self.choices = [ChoiceState(i, frontend.register(self), p) for i, p in enumerate(prompt_index)]
        self.by_uid = {c.uid: c for c in self.choices}
        self.unfinished = set(self.by_uid)
        self.start = time.perf_counter()
        self.checked = time.monotonic()

    @property
    def done(self) -> bool:
        return not self.unfinished

    def push(self, uid: int, text: str, token_ids: list[int], info: dict[str, Any] | None = None) -> None:
        """A reply (a ReplyBatch row) for one of this request's uids (the listener calls it). While the
        handler has not taken the uid's previous reply, the new one joins it: a handler that falls behind
        renders and writes one chunk for all the tokens that arrived meanwhile, not one per token."""
        last = self.unread.get(uid)
        if last is not None and not last.finished and (info is None or "error" not in info):
            last.text += text
            last.token_ids += token_ids
            if info:
                _join(last, info)
            return
        reply = UserReply(uid, text, token_ids) if info is None else UserReply(uid, text, token_ids, **info)
        self.inbox.append(reply)
        self.unread[uid] = reply
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _take(self) -> tuple[ChoiceState, UserReply]:
        reply = self.inbox.popleft()
        if self.unread.get(reply.uid) is reply:
            del self.unread[reply.uid]
        choice = self.by_uid[reply.uid]
        self._apply(choice, reply)
        return choice, reply

    async def _wait(self, request: Request | None) -> None:
        """Until a reply is there. With `request`, checks for a disconnect every half second (a
        non-streaming handler is not cancelled when its client goes away)."""
        while not self.inbox:
            self.waiter = asyncio.get_running_loop().create_future()
            if request is None:
                await self.waiter
                continue
            if time.monotonic() - self.checked > DISCONNECT_POLL:
                self.checked = time.monotonic()
                if await request.is_disconnected():
                    raise ClientGone
            try:
                await asyncio.wait_for(self.waiter, timeout=DISCONNECT_POLL)
            except asyncio.TimeoutError:
                continue

    async def next(self, request: Request | None = None) -> tuple[ChoiceState, UserReply]:
        """The next reply of any choice."""
        await self._wait(request)
        return self._take()

    async def drain(self) -> list[tuple[ChoiceState, UserReply]]:
        """Every reply that arrived since the last call (at least one: waits for it)."""
        await self._wait(None)
        items = []
        while self.inbox:
            items.append(self._take())
        return items

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
        if reply.extras:
            if "prompt_logprobs" in reply.extras:
                c.prompt_logprobs = PromptLogprobs(**reply.extras["prompt_logprobs"])
            c.embedding = reply.extras.get("embedding", c.embedding)
        c.completion_tokens = reply.completion_tokens or c.completion_tokens + len(reply.token_ids)
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
