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


@serializable
@dataclass
class DetokenizeMsg:
    """Scheduler -> detokenizer: one new token of one request, or (with `error`) a rejected request."""

    uid: int
    token_id: int = -1  # -1: no token (an abort or an error)
    finished: bool = False
    finish_reason: str | None = None  # a FinishReason (its plain value once deserialized)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None
    error_param: str | None = None  # the rejected field, generic name (InvalidRequest.param)
    cached_tokens: int = 0  # prompt tokens the prefix cache held when the request was admitted


@serializable
@dataclass
class BatchDetokenizeMsg:
    """Every token one scheduler step produced, in one message."""

    msgs: list[DetokenizeMsg] = field(default_factory=list)


@serializable
@dataclass
class StatsMsg:
    """Scheduler statistics (Scheduler.stats() plus the IO loop's counters), forwarded to the API server
    for /metrics."""

    stats: dict[str, float] = field(default_factory=dict)
