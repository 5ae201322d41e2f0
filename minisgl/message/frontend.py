"""Messages to the API server (or the shell)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .serialize import serializable


@serializable
@dataclass
class TokenLogprob:
    """The sampled token's log-probability and the most likely alternatives: each as its text (the
    tokenizer's decoding of it alone, U+FFFD where it holds part of a UTF-8 character) and its real bytes."""

    token: str
    token_id: int
    logprob: float
    top: list[tuple[str, int, float]] = field(default_factory=list)  # (token, token_id, logprob)
    token_bytes: bytes = b""
    top_bytes: list[bytes] = field(default_factory=list)  # the bytes of each `top` token, in its order


@serializable
@dataclass
class UserReply:
    """New text of one request. `text` never ends inside a UTF-8 character nor inside a possible stop
    string; on the last reply `finished` is set and the usage counts are final."""

    uid: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # the tokens that arrived with this reply
    finished: bool = False
    finish_reason: str | None = None  # a FinishReason (its plain value once deserialized)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # a rejected request: the message names the problem
    error_param: str | None = None  # and the field, by its generic name (`max_tokens`, `prompt`, ...)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission


@serializable
@dataclass
class BatchFrontendMsg:
    replies: list[UserReply] = field(default_factory=list)
