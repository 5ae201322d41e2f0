"""Response shapes: one renderer per endpoint kind (chat, completions, native generate), streamed as SSE
chunks or as one JSON body, and the OpenAI logprob shapes."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson

from minisgl.message import TokenLogprob, UserReply

from .prompt_logprobs import Piece, completion_prompt, sglang_input, vllm_prompt
from .reasoning import CLOSED, ReasoningFormat, ReasoningSplitter, ReasoningText, split
from .routing import ChoiceState, Generation
from .tool_parser import (
    CallArgs,
    CallStart,
    Event,
    ParsedCall,
    Text,
    ToolCallParser,
    ToolFormat,
    parse_tool_calls,
)


def sse(obj: Any) -> bytes:
    """One server-sent event (orjson: several times faster than json on the per-token path; it writes
    UTF-8 as is, as json.dumps(ensure_ascii=False) does, and a non-finite float as null)."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def chat_logprobs(items: list[TokenLogprob]) -> dict[str, Any]:
    """Chat's `logprobs`: per token its text, logprob, real bytes (part of a UTF-8 character, for a token
    that holds one) and the top alternatives."""

    def entry(token: str, lp: float, raw: bytes | None) -> dict[str, Any]:
        return {"token": token, "logprob": lp, "bytes": list(token.encode() if raw is None else raw)}

    def top(t: TokenLogprob) -> list[dict[str, Any]]:
        raws = [*t.top_bytes, *[None] * (len(t.top) - len(t.top_bytes))]  # bytes only where known
        return [entry(s, lp, raw) for (s, _, lp), raw in zip(t.top, raws)]

    return {"content": [dict(entry(t.token, t.logprob, t.token_bytes), top_logprobs=top(t)) for t in items]}


def completion_logprobs(items: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """Completions' `logprobs`: parallel lists, with each token's character offset in the text."""
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
class Renderer:
    """How one endpoint shapes its replies; the base renders nothing extra around the deltas."""

    model: str
    rid: str
    created: int = field(default_factory=lambda: int(time.time()))
    include_usage: bool = False
    logprobs: bool = False

    def stream_start(self, gen: Generation) -> list[bytes]:
        """Chunks sent before the first token."""
        return []

    def token_ids(self, gen: Generation) -> list[int]:
        """The tokens whose texts `full` will show apart from the output's (the prompt's, with its
        log-probabilities): decoded in a thread before it runs."""
        ids: list[int] = []
        for c in gen.choices:
            lp = c.prompt_logprobs
            if lp is not None:
                ids += lp.ids
                ids += [t for top in lp.top_ids for t in top]
        return ids

    def stream_delta(self, c: ChoiceState, reply: UserReply, offset: int) -> bytes | None:
        """The chunk for one reply of choice `c` (`offset`: characters of `c` already sent)."""
        raise NotImplementedError

    def stream_finish(self, c: ChoiceState) -> bytes | None:
        """The chunk that ends choice `c`."""
        return None

    def stream_usage(self, gen: Generation) -> bytes | None:
        """The final usage chunk, if asked for."""
        return None

    def full(self, gen: Generation) -> Any:
        """The non-streamed response body."""
        raise NotImplementedError


class _OpenAIRenderer(Renderer):
    """What chat and completions share: the envelope of every chunk and body, the usage chunk."""

    OBJECT: ClassVar[str]
    CHUNK_OBJECT: ClassVar[str]

    def _chunk(self, choices: list[dict[str, Any]], usage: Any = None) -> bytes:
        body = self._envelope(self.CHUNK_OBJECT, choices)
        if self.include_usage:
            body["usage"] = usage
        return sse(body)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _delta(
        self, c: ChoiceState, text: str, lps: list[TokenLogprob] | None, offset: int
    ) -> dict[str, Any]:
        raise NotImplementedError

    def _final(self, c: ChoiceState) -> dict[str, Any]:
        raise NotImplementedError

    def stream_delta(self, c: ChoiceState, reply: UserReply, offset: int) -> bytes | None:
        lps = reply.logprobs if self.logprobs else None
        if not reply.text and not lps:
            return None
        return self._chunk([dict(self._delta(c, reply.text, lps, offset), finish_reason=None)])

    def stream_finish(self, c: ChoiceState) -> bytes | None:
        return self._chunk([dict(self._delta(c, "", None, 0), finish_reason=c.finish_reason)])

    def stream_usage(self, gen: Generation) -> bytes | None:
        return self._chunk([], gen.usage()) if self.include_usage else None

    def full(self, gen: Generation) -> Any:
        body = self._envelope(self.OBJECT, [self._final(c) for c in gen.choices])
        body["usage"] = gen.usage()
        return body


def call_id() -> str:
    """A tool call's id, as OpenAI writes them."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _finish_reason(c: ChoiceState, called: bool) -> str | None:
    # a turn that ended by itself after calling tools asks for their results; "length" stays: cut short
    return "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason


@dataclass(frozen=True)
class ChatOutput:
    """How a chat's output is read: its reasoning (format, and where the output starts: reasoning.py) and
    its tool calls (the format, when the request has tools)."""

    reasoning: ReasoningFormat | None = None
    state: str = CLOSED
    tools: ToolFormat | None = None
    forced: bool = False  # tool_choice forces a call (the output holds calls only)

    @property
    def splits(self) -> bool:
        return self.reasoning is not None and self.state != CLOSED

    def parser(self) -> ChatOutputParser:
        return ChatOutputParser(
            ReasoningSplitter(self.reasoning, self.state) if self.splits and self.reasoning else None,
            ToolCallParser(self.tools, self.forced) if self.tools is not None else None,
        )

    def parse(self, text: str) -> tuple[str | None, str | None, list[ParsedCall]]:
        """A whole output as (reasoning, content, tool calls); reasoning None: there was none."""
        reasoning, content = split(text, self.reasoning, self.state) if self.reasoning else (None, text)
        calls: list[ParsedCall] = []
        if self.tools is not None:
            content, calls = parse_tool_calls(content, self.tools, self.forced)
        return reasoning, content, calls


@dataclass
class ChatOutputParser:
    """One choice's text, as it streams, as events: reasoning, then the answer's text and tool calls."""

    splitter: ReasoningSplitter | None
    tools: ToolCallParser | None

    def feed(self, text: str) -> list[Event | ReasoningText]:
        if self.splitter is None:
            return self._answer(text, False)
        reasoning, content = self.splitter.feed(text)
        return ([ReasoningText(reasoning)] if reasoning else []) + self._answer(content, False)

    def finish(self) -> list[Event | ReasoningText]:
        if self.splitter is None:
            return self._answer("", True)
        reasoning, content = self.splitter.finish()
        return ([ReasoningText(reasoning)] if reasoning else []) + self._answer(content, True)

    def _answer(self, text: str, final: bool) -> list[Event | ReasoningText]:
        if self.tools is None:
            return [Text(text)] if text else []
        return self.tools.feed(text) + (self.tools.finish() if final else [])

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.count > 0


@dataclass
class ChatRenderer(_OpenAIRenderer):
    """/v1/chat/completions: `chat.completion` bodies, deltas after an opening role chunk. The `output`
    says what is read out of each choice's text: the reasoning (`message.reasoning_content` and
    `message.reasoning`, streamed as deltas of both) and tool calls (`message.tool_calls`, streamed as
    `delta.tool_calls` with the arguments in pieces); neither reaches `content`."""

    OBJECT = "chat.completion"
    CHUNK_OBJECT = "chat.completion.chunk"
    output: ChatOutput = field(default_factory=ChatOutput)
    parsers: dict[int, ChatOutputParser] = field(default_factory=dict)  # per choice, while streaming

    @property
    def _plain(self) -> bool:
        return self.output.tools is None and not self.output.splits

    def stream_delta(self, c: ChoiceState, reply: UserReply, offset: int) -> bytes | None:
        if self._plain:
            return super().stream_delta(c, reply, offset)
        parser = self.parsers.setdefault(c.index, self.output.parser())
        lps = reply.logprobs if self.logprobs else None
        return self._event_chunks(c, parser.feed(reply.text), lps)

    def stream_finish(self, c: ChoiceState) -> bytes | None:
        if self._plain:
            return super().stream_finish(c)
        parser = self.parsers.setdefault(c.index, self.output.parser())
        rest = self._event_chunks(c, parser.finish(), None) or b""
        reason = _finish_reason(c, parser.called)
        return rest + self._chunk(
            [{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": reason}]
        )

    def _event_chunks(
        self, c: ChoiceState, events: list[Event | ReasoningText], lps: list[TokenLogprob] | None
    ) -> bytes | None:
        """One chunk per event (reasoning, text, a call's opening, a piece of its arguments); the reply's
        logprobs ride on the first (on an empty delta when the reply's text was all held back)."""
        deltas: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, ReasoningText):
                deltas.append({"reasoning_content": e.text, "reasoning": e.text})
            elif isinstance(e, Text):
                deltas.append({"content": e.text})
            elif isinstance(e, CallStart):
                fn = {"name": e.name, "arguments": ""}
                call = {"index": e.index, "id": call_id(), "type": "function", "function": fn}
                deltas.append({"tool_calls": [call]})
            elif isinstance(e, CallArgs):
                deltas.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
        if lps and not deltas:
            deltas.append({})
        chunks = [
            {"index": c.index, "delta": d, "logprobs": chat_logprobs(lps) if lps and k == 0 else None}
            for k, d in enumerate(deltas)
        ]
        return b"".join(self._chunk([dict(ch, finish_reason=None)]) for ch in chunks) or None

    def stream_start(self, gen: Generation) -> list[bytes]:
        opening = {"role": "assistant", "content": ""}
        return [
            self._chunk([{"index": c.index, "delta": opening, "logprobs": None, "finish_reason": None}])
            for c in gen.choices
        ]

    def _delta(
        self, c: ChoiceState, text: str, lps: list[TokenLogprob] | None, offset: int
    ) -> dict[str, Any]:
        delta = {"content": text} if text or lps else {}  # the finishing chunk has an empty delta
        return {"index": c.index, "delta": delta, "logprobs": chat_logprobs(lps) if lps else None}

    def _final(self, c: ChoiceState) -> dict[str, Any]:
        reasoning, content, calls = self.output.parse(c.text)
        if reasoning is not None and not content:
            content = None  # all of it was reasoning (as a reply of only tool calls)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.output.reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = reasoning
        if calls:
            message["tool_calls"] = [
                {"id": call_id(), "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
                for t in calls
            ]
        return {
            "index": c.index,
            "message": message,
            "logprobs": chat_logprobs(c.logprobs) if self.logprobs else None,
            "finish_reason": _finish_reason(c, bool(calls)),
        }


@dataclass
class CompletionRenderer(_OpenAIRenderer):
    """/v1/completions: `text_completion` bodies and chunks. With `echo` (the text of each prompt, by
    prompt index) the prompt comes first in `text` and, with logprobs, its tokens first in `logprobs`
    (the first one's entries null, as OpenAI's); `prompt_logprobs` adds vLLM's field of that name.
    `piece` is a token's text (decoded alone), for the prompt's tokens."""

    OBJECT = "text_completion"
    CHUNK_OBJECT = "text_completion"
    echo: list[str] | None = None
    top: int = 0  # `logprobs`: the alternatives shown per position
    prompt_logprobs: bool = False
    piece: Piece | None = None

    def _prompt_part(self, c: ChoiceState) -> tuple[str, dict[str, list[Any]] | None]:
        """The echoed prompt's text and its logprobs lists (None without logprobs)."""
        if self.echo is None:
            return "", None
        text = self.echo[c.prompt_index]
        lp = c.prompt_logprobs
        if not self.logprobs or lp is None or self.piece is None:
            return text, None
        return text, completion_prompt(lp.ids, lp, self.piece, self.top)

    def _extra(self, c: ChoiceState) -> dict[str, Any]:
        if not self.prompt_logprobs or self.piece is None:
            return {}
        lp = c.prompt_logprobs
        return {"prompt_logprobs": vllm_prompt(lp.ids, lp, self.piece) if lp is not None else None}

    def stream_delta(self, c: ChoiceState, reply: UserReply, offset: int) -> bytes | None:
        if (self.echo is None and not self.prompt_logprobs) or c.index in self._started:
            return super().stream_delta(c, reply, offset)
        self._started.add(c.index)  # the first reply: the prompt comes first
        prompt, prompt_lps = self._prompt_part(c)
        lps = reply.logprobs if self.logprobs else None
        choice = self._delta(c, prompt + reply.text, lps, len(prompt))
        if prompt_lps is not None:
            choice["logprobs"] = _joined(prompt_lps, choice["logprobs"])
        return self._chunk([dict(choice, **self._extra(c), finish_reason=None)])

    def _delta(
        self, c: ChoiceState, text: str, lps: list[TokenLogprob] | None, offset: int
    ) -> dict[str, Any]:
        return {"index": c.index, "text": text, "logprobs": completion_logprobs(lps, offset) if lps else None}

    def _final(self, c: ChoiceState) -> dict[str, Any]:
        prompt, prompt_lps = self._prompt_part(c)
        lps = completion_logprobs(c.logprobs, len(prompt)) if self.logprobs else None
        if prompt_lps is not None:
            lps = _joined(prompt_lps, lps)
        return {
            "index": c.index,
            "text": prompt + c.text,
            "logprobs": lps,
            "finish_reason": c.finish_reason,
            **self._extra(c),
        }

    def __post_init__(self) -> None:
        self._started: set[int] = set()


def _joined(first: dict[str, list[Any]], then: dict[str, list[Any]] | None) -> dict[str, list[Any]]:
    """Two sets of completions' parallel logprob lists, one after the other."""
    return {k: v + (then[k] if then else []) for k, v in first.items()}


@dataclass
class GenerateRenderer(Renderer):
    """/generate: SGLang's native shape, text and output ids with a meta_info per choice; with
    `logprobs` (SGLang's `return_logprob`) its `output_token_logprobs` / `output_top_logprobs` and, from
    prompt position `input_start` (`logprob_start_len` >= 0), `input_token_logprobs` / `input_top_logprobs`:
    [logprob, token id, text] triples, the text only with `texts` (`return_text_in_logprobs`)."""

    input_start: int | None = None
    texts: bool = False
    piece: Piece | None = None

    def _meta(self, c: ChoiceState, finished: bool, lps: list[TokenLogprob] | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": c.uid,
            "prompt_tokens": c.prompt_tokens,
            "cached_tokens": c.cached_tokens,
            "completion_tokens": c.completion_tokens,
            "finish_reason": {"type": c.finish_reason} if finished else None,
        }
        if self.logprobs:
            lps = c.logprobs if lps is None else lps
            meta["output_token_logprobs"] = [[t.logprob, t.token_id, self._text(t.token)] for t in lps]
            meta["output_top_logprobs"] = [[[v, i, self._text(s)] for s, i, v in t.top] for t in lps]
            if self.input_start is not None and c.prompt_logprobs is not None:
                lp = c.prompt_logprobs
                piece = self.piece if self.texts else None
                tokens, top = sglang_input(lp.ids, lp, self.input_start, piece)
                meta["input_token_logprobs"], meta["input_top_logprobs"] = tokens, top
        return meta

    def _text(self, s: str) -> str | None:
        return s if self.texts else None

    def stream_delta(self, c: ChoiceState, reply: UserReply, offset: int) -> bytes | None:
        meta = self._meta(c, reply.finished, reply.logprobs or [])
        return sse({"index": c.index, "text": reply.text, "output_ids": reply.token_ids, "meta_info": meta})

    def full(self, gen: Generation) -> Any:
        out = [
            {"text": c.text, "output_ids": c.token_ids, "meta_info": self._meta(c, True)} for c in gen.choices
        ]
        return out[0] if len(out) == 1 else out
