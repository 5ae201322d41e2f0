"""The OpenAI-compatible HTTP API (FastAPI + uvicorn), in the launcher's main process.

Each HTTP request gets one uid per choice (prompt x n); its TokenizeMsgs go to the tokenizer, and a single
background task routes every reply from the detokenizer to the asyncio.Queue of the request that owns the
uid. A client that goes away gets its unfinished uids aborted, which frees their slots and KV.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, ValidationError

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortMsg,
    BatchFrontendMsg,
    StatsMsg,
    TokenizeMsg,
    TokenLogprob,
    UserReply,
    dumps,
    loads,
)
from minisgl.utils import init_logger

from .args import ServerArgs
from .zmq_queue import ZmqAsyncPullQueue, ZmqAsyncPushQueue

logger = init_logger(__name__, "api")

MAX_N = 128  # choices per request
DISCONNECT_POLL = 0.5  # seconds between checks that a non-streaming client is still there
NO_LIMIT = 1 << 30  # max_tokens when the client gives none: the context length decides


# ---- errors ------------------------------------------------------------------------------------------
class APIError(Exception):
    """A client mistake: HTTP 400 with an OpenAI-style error object naming the field."""

    def __init__(
        self, message: str, param: str | None = None, code: str | None = None, status: int = 400
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def response(self) -> JSONResponse:
        err = {
            "message": self.message,
            "type": "invalid_request_error",
            "param": self.param,
            "code": self.code,
        }
        return JSONResponse({"error": err}, status_code=self.status)


class ClientGone(Exception):
    """The HTTP client disconnected while its request was generating."""


# ---- request bodies ----------------------------------------------------------------------------------
class _Body(BaseModel):
    # strict: "5" is not an integer and true is not a number; unknown OpenAI fields are accepted and ignored
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Body):
    include_usage: bool | None = None


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    stop: str | list[str | int] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None


class GenerateRequest(_Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: bool | None = None


_TYPE_HINTS = {  # what a field must be, for the error message
    "messages": "a list of {role, content} objects",
    "role": "a string",
    "content": "a string or a list of {type: text, text} parts",
    "prompt": "a string, a list of token ids, a list of strings or a list of token-id lists",
    "stop": "a string or a list of strings / token ids",
    "text": "a string or a list of strings",
    "input_ids": "a list of token ids or a list of token-id lists",
}


def _validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    loc = list(err["loc"])
    param = str(loc[0]) if loc else None
    if param == "messages" and len(loc) > 1 and isinstance(loc[1], int):
        param += f"[{loc[1]}]" + (f".{loc[2]}" if len(loc) > 2 and isinstance(loc[2], str) else "")
    if err["type"] == "missing":
        return APIError(f"'{param}' is required", param, "missing_required_parameter")
    field_name = param.rsplit(".", 1)[-1] if param else ""
    hint = _TYPE_HINTS.get(field_name)
    msg = f"'{param}' must be {hint}" if hint else f"invalid '{param}': {err['msg']}"
    return APIError(msg, param, "invalid_type")


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; a body over `limit` bytes is drained (so the client can read the
    answer) and refused."""
    size = 0
    body = bytearray()
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            body += chunk
    if size > limit:
        raise APIError(
            f"the request body has {size} bytes; the limit is {limit} (--max-request-bytes)",
            None,
            "request_too_large",
        )
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object", None, "invalid_json")
    return data


def _parse(model: type, data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None


# ---- sampling parameters -----------------------------------------------------------------------------
@dataclass
class Sampling:
    params: SamplingParams
    stop: list[str]
    max_tokens_auto: bool
    n: int

    def for_choice(self, i: int) -> SamplingParams:
        """Choice i of n: its own seed (seed + i), so the choices differ yet are reproducible."""
        p = self.params
        seed = None if p.seed is None else p.seed + i
        return SamplingParams(
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            max_tokens=p.max_tokens,
            ignore_eos=p.ignore_eos,
            seed=seed,
            stop_token_ids=list(p.stop_token_ids),
            logprobs=p.logprobs,
            top_logprobs=p.top_logprobs,
        )


def _sampling(
    req: _Sampling, max_tokens: int | None, max_tokens_param: str, logprobs: bool, top_logprobs: int
) -> Sampling:
    """Check req's sampling fields and the given token limit (naming the bad one) and build the
    SamplingParams."""
    temperature, top_p, top_k, n, stop = req.temperature, req.top_p, req.top_k, req.n, req.stop
    if max_tokens is not None and max_tokens < 1:
        raise APIError(
            f"'{max_tokens_param}' must be at least 1, got {max_tokens}", max_tokens_param, "invalid_value"
        )
    temperature = 1.0 if temperature is None else temperature
    if not temperature >= 0:  # also rejects NaN
        raise APIError(f"'temperature' must be >= 0, got {temperature}", "temperature", "invalid_value")
    top_p = 1.0 if top_p is None else top_p
    if not 0 < top_p <= 1:
        raise APIError(f"'top_p' must be in (0, 1], got {top_p}", "top_p", "invalid_value")
    top_k = -1 if top_k in (None, 0) else top_k
    if top_k < -1:
        raise APIError(
            f"'top_k' must be -1 or 0 (no limit) or positive, got {top_k}", "top_k", "invalid_value"
        )
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise APIError(f"'n' must be in [1, {MAX_N}], got {n}", "n", "invalid_value")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    stop_strings = [s for s in stops if isinstance(s, str) and s]
    stop_ids = [s for s in stops if isinstance(s, int)] + list(req.stop_token_ids or [])
    if any(t < 0 for t in stop_ids):
        raise APIError("stop token ids must be >= 0", "stop", "invalid_value")
    if not 0 <= top_logprobs <= 20:
        raise APIError(
            f"'top_logprobs' must be in [0, 20], got {top_logprobs}", "top_logprobs", "invalid_value"
        )
    params = SamplingParams(
        temperature=float(temperature),
        top_k=top_k,
        top_p=float(top_p),
        max_tokens=NO_LIMIT if max_tokens is None else max_tokens,
        ignore_eos=bool(req.ignore_eos),
        seed=req.seed,
        stop_token_ids=stop_ids,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    try:
        params.validate()
    except ValueError as e:
        raise APIError(str(e), None, "invalid_value") from None
    return Sampling(params, stop_strings, max_tokens is None, n)


def _chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    if not req.messages:
        raise APIError("'messages' must not be empty", "messages", "invalid_value")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in ("system", "user", "assistant", "tool", "developer"):
            raise APIError(
                f"messages[{i}].role must be system, user, assistant, tool or developer, got {m.role!r}",
                f"messages[{i}].role",
                "invalid_value",
            )
        if isinstance(m.content, list):
            if any(p.type != "text" or p.text is None for p in m.content):
                raise APIError(
                    "only text content parts are supported", f"messages[{i}].content", "invalid_value"
                )
            content = "".join(p.text or "" for p in m.content)
        else:
            content = m.content or ""
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


Prompt = tuple[str | None, list[int] | None]  # (text, input_ids): exactly one is set


def _prompts(value: Any, param: str) -> list[Prompt]:
    """A string, token ids, or a list of either -> a list of prompts."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif value and all(isinstance(t, int) for t in value):
        items = [value]
    else:
        items = list(value)
    if not items:
        raise APIError(f"'{param}' must not be empty", param, "invalid_value")
    prompts: list[Prompt] = []
    for item in items:
        if not item:
            raise APIError(
                f"'{param}' must not be empty (nor contain an empty prompt)", param, "invalid_value"
            )
        if isinstance(item, str):
            prompts.append((item, None))
        elif any(t < 0 for t in item):
            raise APIError(f"'{param}' token ids must be >= 0", param, "invalid_value")
        else:
            prompts.append((None, list(item)))
    return prompts


def _fan_out(prompts: list[Prompt], s: Sampling) -> tuple[list[TokenizeMsg], list[int]]:
    """One TokenizeMsg per (prompt, choice), prompt-major, and the prompt index of each."""
    msgs: list[TokenizeMsg] = []
    index: list[int] = []
    for p, (text, ids) in enumerate(prompts):
        for i in range(s.n):
            msgs.append(
                TokenizeMsg(
                    -1,
                    s.for_choice(i),
                    text=text,
                    input_ids=ids,
                    stop=s.stop,
                    max_tokens_auto=s.max_tokens_auto,
                )
            )
            index.append(p)
    return msgs, index


# ---- metrics -----------------------------------------------------------------------------------------
class Metrics:
    """Prometheus metrics: request counters and latencies measured here, gauges from the scheduler."""

    LATENCY_BUCKETS = (
        0.005,
        0.01,
        0.02,
        0.04,
        0.06,
        0.08,
        0.1,
        0.15,
        0.2,
        0.3,
        0.5,
        0.75,
        1.0,
        2.0,
        5.0,
        10.0,
        30.0,
        60.0,
    )
    STATS: ClassVar[dict[str, tuple[str, str]]] = {  # scheduler stats key -> gauge name, help
        "num_running": ("num_requests_running", "Requests in the running batch"),
        "num_waiting": ("num_requests_waiting", "Requests waiting for admission"),
        "kv_used_pages": ("kv_used_pages", "KV pages in use (by requests or the prefix cache)"),
        "kv_cached_pages": ("kv_cached_pages", "KV pages held by the prefix cache"),
        "kv_total_pages": ("kv_total_pages", "KV pages in the pool"),
        "last_batch_size": ("last_batch_size", "Requests in the latest step"),
        "max_batch_size": ("max_batch_size", "Largest number of requests in one step so far"),
        "num_retractions": ("num_retractions", "Requests retracted when decode ran out of KV"),
        "aborted_requests": ("aborted_requests", "Requests the scheduler aborted"),
        "rejected_requests": ("rejected_requests", "Requests the scheduler rejected"),
        "integrity_checks": ("integrity_checks", "Idle-time KV integrity checks run"),
        "integrity_failures": ("integrity_failures", "Idle-time KV integrity checks that found a leak"),
        "prompt_tokens": ("scheduler_prompt_tokens", "Prompt tokens admitted by the scheduler"),
        "cached_prompt_tokens": ("cached_prompt_tokens", "Prompt tokens served from the prefix cache"),
    }

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("minisgl_requests", "HTTP generation requests", ["endpoint"], registry=r)
        self.errors = Counter(
            "minisgl_request_errors", "Requests refused with HTTP 400", ["code"], registry=r
        )
        self.finished = Counter(
            "minisgl_finished_requests", "Finished choices by reason", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("minisgl_prompt_tokens", "Prompt tokens of finished choices", registry=r)
        self.generation_tokens = Counter("minisgl_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(
            "minisgl_time_to_first_token_seconds",
            "Time to first token",
            buckets=self.LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "minisgl_inter_token_latency_seconds",
            "Time between two tokens of a choice",
            buckets=self.LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "minisgl_e2e_request_latency_seconds",
            "Request arrival to last token",
            buckets=self.LATENCY_BUCKETS,
            registry=r,
        )
        self.gauges = {k: Gauge(f"minisgl_{name}", doc, registry=r) for k, (name, doc) in self.STATS.items()}
        self.kv_usage = Gauge("minisgl_kv_usage_ratio", "Fraction of KV pages in use", registry=r)
        self.hit_rate = Gauge(
            "minisgl_prefix_cache_hit_rate", "Fraction of prompt tokens found in the cache", registry=r
        )

    def update(self, stats: dict[str, float]) -> None:
        for key, gauge in self.gauges.items():
            if key in stats:
                gauge.set(stats[key])
        if stats.get("kv_total_pages"):
            self.kv_usage.set(stats.get("kv_used_pages", 0) / stats["kv_total_pages"])
        if stats.get("prompt_tokens"):
            self.hit_rate.set(stats.get("cached_prompt_tokens", 0) / stats["prompt_tokens"])

    def render(self) -> bytes:
        return generate_latest(self.registry)


# ---- routing replies to requests ---------------------------------------------------------------------
class FrontendManager:
    """The API server's side of ZMQ: sends TokenizeMsg/AbortMsg, routes each UserReply to its request."""

    def __init__(self, args: ServerArgs) -> None:
        # with N tokenizers this socket binds and spreads requests over them; otherwise it connects to the worker
        self.send: ZmqAsyncPushQueue[Any] = ZmqAsyncPushQueue(
            args.request_addr, create=args.num_tokenizer > 0, encoder=dumps
        )
        self.recv: ZmqAsyncPullQueue[Any] = ZmqAsyncPullQueue(args.frontend_addr, create=True, decoder=loads)
        self.uids = itertools.count()
        self.queues: dict[int, asyncio.Queue[UserReply]] = {}
        self.metrics = Metrics()
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
        for uid in sorted(uids):
            logger.warning(f"Aborting request {uid}")
            self.send.put_nowait(AbortMsg(uid))

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
        c.completion_tokens = reply.completion_tokens or c.completion_tokens
        if reply.finished:
            self.unfinished.discard(c.uid)
            self.frontend.unregister(c.uid)
            c.finish_reason = reply.finish_reason
            if reply.error is None:
                self.metrics.finished.labels(reply.finish_reason or "unknown").inc()
                self.metrics.prompt_tokens.inc(c.prompt_tokens)
                self.metrics.e2e.observe(now - self.start)

    def usage(self) -> dict[str, int]:
        prompts: dict[int, int] = {}
        for c in self.choices:  # n choices of one prompt count its tokens once, as OpenAI does
            prompts[c.prompt_index] = c.prompt_tokens
        prompt = sum(prompts.values())
        completion = sum(c.completion_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def close(self) -> None:
        """Abort every choice still generating (the client is gone or the request failed)."""
        for c in self.choices:
            self.frontend.unregister(c.uid)
        if self.unfinished:
            self.frontend.abort(self.unfinished)
            self.unfinished.clear()


def _error_param(error: str, prompt_param: str, max_tokens_param: str) -> str:
    return max_tokens_param if "max_tokens" in error else prompt_param


# ---- response shapes ---------------------------------------------------------------------------------
def _chat_logprobs(items: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token: str, lp: float) -> dict[str, Any]:
        return {"token": token, "logprob": lp, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            dict(entry(t.token, t.logprob), top_logprobs=[entry(s, lp) for s, _, lp in t.top]) for t in items
        ]
    }


def _completion_logprobs(items: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    offsets, pos = [], offset
    for t in items:
        offsets.append(pos)
        pos += len(t.token)
    return {
        "tokens": [t.token for t in items],
        "token_logprobs": [t.logprob for t in items],
        "top_logprobs": [{s: lp for s, _, lp in t.top} for t in items],
        "text_offset": offsets,
    }


@dataclass
class Endpoint:
    """How one endpoint shapes its replies (chat, completions or native generate)."""

    kind: str  # "chat" | "completion" | "generate"
    model: str
    rid: str
    created: int = field(default_factory=lambda: int(time.time()))
    include_usage: bool = False
    logprobs: bool = False

    def _chunk(self, choices: list[dict[str, Any]], usage: Any = None) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body: dict[str, Any] = {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = usage
        return _sse(body)

    def stream_start(self, gen: Generation) -> list[bytes]:
        if self.kind != "chat":
            return []
        return [
            self._chunk(
                [
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for c in gen.choices
        ]

    def stream_delta(self, c: ChoiceState, reply: UserReply, offset: int) -> bytes | None:
        lps = reply.logprobs if self.logprobs else None
        if self.kind == "generate":
            meta = {
                "id": c.uid,
                "prompt_tokens": c.prompt_tokens,
                "completion_tokens": c.completion_tokens,
                "finish_reason": {"type": c.finish_reason} if reply.finished else None,
            }
            return _sse(
                {"index": c.index, "text": reply.text, "output_ids": reply.token_ids, "meta_info": meta}
            )
        if not reply.text and not lps:
            return None
        if self.kind == "chat":
            choice = {
                "index": c.index,
                "delta": {"content": reply.text},
                "logprobs": _chat_logprobs(lps) if lps else None,
                "finish_reason": None,
            }
        else:
            choice = {
                "index": c.index,
                "text": reply.text,
                "logprobs": _completion_logprobs(lps, offset) if lps else None,
                "finish_reason": None,
            }
        return self._chunk([choice])

    def stream_finish(self, c: ChoiceState) -> bytes | None:
        if self.kind == "generate":
            return None
        if self.kind == "chat":
            choice = {"index": c.index, "delta": {}, "logprobs": None, "finish_reason": c.finish_reason}
        else:
            choice = {"index": c.index, "text": "", "logprobs": None, "finish_reason": c.finish_reason}
        return self._chunk([choice])

    def stream_usage(self, gen: Generation) -> bytes | None:
        return self._chunk([], gen.usage()) if self.include_usage and self.kind != "generate" else None

    def full(self, gen: Generation) -> Any:
        if self.kind == "generate":
            out = [
                {
                    "text": c.text,
                    "output_ids": c.token_ids,
                    "meta_info": {
                        "id": c.uid,
                        "prompt_tokens": c.prompt_tokens,
                        "completion_tokens": c.completion_tokens,
                        "finish_reason": {"type": c.finish_reason},
                    },
                }
                for c in gen.choices
            ]
            return out[0] if len(out) == 1 else out
        choices = []
        for c in gen.choices:
            if self.kind == "chat":
                choices.append(
                    {
                        "index": c.index,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": _chat_logprobs(c.logprobs) if self.logprobs else None,
                        "finish_reason": c.finish_reason,
                    }
                )
            else:
                choices.append(
                    {
                        "index": c.index,
                        "text": c.text,
                        "logprobs": _completion_logprobs(c.logprobs) if self.logprobs else None,
                        "finish_reason": c.finish_reason,
                    }
                )
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": gen.usage(),
        }


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


# ---- the application ---------------------------------------------------------------------------------
def create_app(args: ServerArgs, max_seq_len: int = 0, health: Callable[[], bool] = lambda: True) -> FastAPI:
    """The FastAPI application. `health` tells /health whether every worker process is alive."""
    state: dict[str, FrontendManager] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        frontend = FrontendManager(args)
        frontend.start()
        state["frontend"] = frontend
        yield
        frontend.stop()

    app = FastAPI(title="minisgl", lifespan=lifespan)

    def frontend() -> FrontendManager:
        return state["frontend"]

    def refuse(e: APIError) -> JSONResponse:
        frontend().metrics.errors.labels(e.code or "other").inc()
        return e.response()

    async def run(
        request: Request,
        endpoint: Endpoint,
        msgs: list[TokenizeMsg],
        prompt_index: list[int],
        stream: bool,
        prompt_param: str,
        max_tokens_param: str,
    ) -> Response:
        gen = Generation(frontend(), prompt_index)
        for msg, c in zip(msgs, gen.choices):
            msg.uid = c.uid
        try:
            await frontend().submit(msgs)
            if not stream:
                while not gen.done:
                    c, reply = await gen.next(request)
                    if reply.error is not None:
                        raise APIError(
                            reply.error,
                            _error_param(reply.error, prompt_param, max_tokens_param),
                            "invalid_value",
                        )
                return JSONResponse(endpoint.full(gen))
            first = await gen.next(request)  # a rejected request still gets a plain HTTP 400
            if first[1].error is not None:
                raise APIError(
                    first[1].error,
                    _error_param(first[1].error, prompt_param, max_tokens_param),
                    "invalid_value",
                )
        except APIError as e:
            gen.close()
            return refuse(e)
        except BaseException:  # the client went away (or the server is shutting down): abort what runs
            gen.close()
            raise
        return StreamingResponse(
            _stream(gen, endpoint, first),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def _stream(
        gen: Generation, endpoint: Endpoint, first: tuple[ChoiceState, UserReply]
    ) -> AsyncIterator[bytes]:
        """SSE frames; if the client disconnects, starlette cancels this generator and `finally` aborts."""
        try:
            for chunk in endpoint.stream_start(gen):
                yield chunk
            item: tuple[ChoiceState, UserReply] | None = first
            sent: dict[int, int] = {}
            while item is not None:
                c, reply = item
                if reply.error is not None:  # one prompt of several was rejected
                    yield _sse(
                        {
                            "error": {
                                "message": reply.error,
                                "type": "invalid_request_error",
                                "param": None,
                                "code": "invalid_value",
                            }
                        }
                    )
                    break
                chunk = endpoint.stream_delta(c, reply, sent.get(c.index, 0))
                sent[c.index] = sent.get(c.index, 0) + len(reply.text)
                if chunk is not None:
                    yield chunk
                if reply.finished:
                    end = endpoint.stream_finish(c)
                    if end is not None:
                        yield end
                item = None if gen.done else await gen.next()
            else:
                usage = endpoint.stream_usage(gen)
                if usage is not None:
                    yield usage
            yield b"data: [DONE]\n\n"
        finally:
            gen.close()

    async def guarded(request: Request, handler: Callable[[dict[str, Any]], Any]) -> Response:
        try:
            data = await _read_json(request, args.max_request_bytes)
            return await handler(data)
        except APIError as e:
            return refuse(e)
        except ClientGone:
            return Response(status_code=499)

    def model_name(requested: str | None) -> str:
        return requested or args.served_model_name

    @app.get("/v1/models")
    async def v1_models() -> dict[str, Any]:
        card = {
            "id": args.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "minisgl",
            "root": args.model_path,
            "max_model_len": max_seq_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health_check() -> Response:
        ok = health()
        return JSONResponse({"status": "ok" if ok else "unhealthy"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(frontend().metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        async def handle(data: dict[str, Any]) -> Response:
            req: ChatCompletionRequest = _parse(ChatCompletionRequest, data)
            messages = _chat_messages(req)
            use_completion = req.max_completion_tokens is not None
            top = req.top_logprobs or 0
            if top and not req.logprobs:
                raise APIError("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
            s = _sampling(
                req,
                req.max_completion_tokens if use_completion else req.max_tokens,
                "max_completion_tokens" if use_completion else "max_tokens",
                bool(req.logprobs),
                top,
            )
            frontend().metrics.requests.labels("chat").inc()
            msgs = [
                TokenizeMsg(
                    -1, s.for_choice(i), messages=messages, stop=s.stop, max_tokens_auto=s.max_tokens_auto
                )
                for i in range(s.n)
            ]
            include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
            endpoint = Endpoint(
                "chat",
                model_name(req.model),
                f"chatcmpl-{next(_rids)}",
                include_usage=include_usage,
                logprobs=bool(req.logprobs),
            )
            return await run(
                request,
                endpoint,
                msgs,
                [0] * s.n,
                bool(req.stream),
                "messages",
                "max_completion_tokens" if use_completion else "max_tokens",
            )

        return await guarded(request, handle)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        async def handle(data: dict[str, Any]) -> Response:
            req: CompletionRequest = _parse(CompletionRequest, data)
            prompts = _prompts(req.prompt, "prompt")
            if req.echo:
                raise APIError("'echo' is not supported", "echo", "unsupported_parameter")
            if req.logprobs is not None and not 0 <= req.logprobs <= 5:
                raise APIError(
                    f"'logprobs' must be in [0, 5], got {req.logprobs}", "logprobs", "invalid_value"
                )
            s = _sampling(req, req.max_tokens, "max_tokens", req.logprobs is not None, req.logprobs or 0)
            frontend().metrics.requests.labels("completions").inc()
            msgs, index = _fan_out(prompts, s)
            include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
            endpoint = Endpoint(
                "completion",
                model_name(req.model),
                f"cmpl-{next(_rids)}",
                include_usage=include_usage,
                logprobs=req.logprobs is not None,
            )
            return await run(request, endpoint, msgs, index, bool(req.stream), "prompt", "max_tokens")

        return await guarded(request, handle)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        async def handle(data: dict[str, Any]) -> Response:
            req: GenerateRequest = _parse(GenerateRequest, data)
            if (req.text is None) == (req.input_ids is None):
                raise APIError("give exactly one of 'text' and 'input_ids'", "text", "invalid_value")
            param = "text" if req.text is not None else "input_ids"
            prompts = _prompts(req.text if req.text is not None else req.input_ids, param)
            sp = _parse(_Sampling, dict(req.sampling_params or {}))
            extra = sp.model_extra or {}
            max_new = extra.get("max_new_tokens", sp.max_tokens)
            if max_new is not None and (not isinstance(max_new, int) or isinstance(max_new, bool)):
                raise APIError("'max_new_tokens' must be an integer", "max_new_tokens", "invalid_type")
            s = _sampling(sp, max_new, "max_new_tokens", False, 0)
            frontend().metrics.requests.labels("generate").inc()
            msgs, index = _fan_out(prompts, s)
            endpoint = Endpoint("generate", args.served_model_name, f"gen-{next(_rids)}")
            return await run(request, endpoint, msgs, index, bool(req.stream), param, "max_new_tokens")

        return await guarded(request, handle)

    return app


_rids = itertools.count()
