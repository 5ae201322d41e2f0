"""Messages to the tokenizer / detokenizer worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.core import SamplingParams

from .serialize import serializable


@serializable
@dataclass
class TokenizeMsg:
    """A request from the API server. Exactly one of `text` (plain prompt), `messages` (chat, goes through the
    chat template) and `input_ids` (already tokenized) is set."""

    uid: int
    sampling_params: SamplingParams
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    stop: list[str] = field(default_factory=list)  # stop strings, applied by the detokenizer
    max_tokens_auto: bool = False  # max_tokens is only a ceiling (see UserMsg)
    tools: list[dict[str, Any]] | None = None  # OpenAI tool definitions for the chat template's `tools`
    chat_template_kwargs: dict[str, Any] | None = None  # the template's other variables (enable_thinking)


@serializable
@dataclass
class DetokenizeStartMsg:
    """Tokenizer -> detokenizer (when they are separate processes): what it needs to know about a new request."""

    uid: int
    prompt_len: int
    prompt_tail: list[int] = field(default_factory=list)  # the last prompt tokens: decoding context
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: bool = False


@dataclass
class DetokenizeMsg:
    """One row of a TokenBatch, as an object: what one step said about one request (a new token, its end,
    or with `error` its rejection). Not sent as such: rows travel as the TokenBatch's columns."""

    uid: int
    token_id: int = -1  # -1: no token (an abort or an error)
    finished: bool = False
    finish_reason: str | None = None  # a FinishReason (its plain value once deserialized)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None
    error_param: str | None = None  # the rejected field, generic name (InvalidRequest.param)
    cached_tokens: int = 0  # prompt tokens the prefix cache held when the request was admitted
    extras: dict[str, Any] | None = None  # once-per-request payloads (see TokenBatch.extras)


@serializable
@dataclass
class TokenBatch:
    """Scheduler -> detokenizer: everything one scheduler step produced, in one message of columns. Row i
    is request `uids[i]` with its new token `token_ids[i]` (-1: none); the parts few rows have are keyed
    by row. A uid may own several rows of one batch (a drained step and the next), in their order."""

    uids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish: dict[int, str] = field(default_factory=dict)  # row -> why its request ended (FinishReason)
    logprobs: dict[int, tuple[float, list[tuple[int, float]] | None]] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)  # row -> prompt tokens the cache held
    errors: dict[int, tuple[str, str | None]] = field(default_factory=dict)  # row -> (message, field)
    extras: dict[int, dict[str, Any]] = field(default_factory=dict)  # row -> e.g. prompt log-probs

    def __len__(self) -> int:
        return len(self.uids)

    def add(self, row: DetokenizeMsg) -> None:
        """Append one row (the rare parts only where set)."""
        i = len(self.uids)
        self.uids.append(row.uid)
        self.token_ids.append(row.token_id)
        if row.finished:
            self.finish[i] = row.finish_reason or ""
        if row.logprob is not None:
            self.logprobs[i] = (row.logprob, row.top_logprobs)
        if row.cached_tokens:
            self.cached_tokens[i] = row.cached_tokens
        if row.error is not None:
            self.errors[i] = (row.error, row.error_param)
        if row.extras:
            self.extras[i] = row.extras

    def row(self, i: int) -> DetokenizeMsg:
        """Row i as an object (for the rare rows: errors, rows that outran their request's start)."""
        lp, top = self.logprobs.get(i, (None, None))
        error, param = self.errors.get(i, (None, None))
        reason = self.finish.get(i)
        return DetokenizeMsg(
            self.uids[i],
            self.token_ids[i],
            reason is not None,
            reason or None,
            lp,
            top,
            error,
            param,
            self.cached_tokens.get(i, 0),
            self.extras.get(i),
        )

    @classmethod
    def of(cls, rows: list[DetokenizeMsg]) -> TokenBatch:
        batch = cls()
        for r in rows:
            batch.add(r)
        return batch


@serializable
@dataclass
class StatsMsg:
    """Scheduler statistics (Scheduler.stats() plus the IO loop's counters), forwarded to the API server
    for /metrics."""

    stats: dict[str, float] = field(default_factory=dict)
