"""Messages to the API server (or the shell)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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


@dataclass
class UserReply:
    """New text of one request. `text` never ends inside a UTF-8 character nor inside a possible stop
    string; on the last reply `finished` is set and the usage counts are final. Built by the receiving
    process from a ReplyBatch row (replies travel as the batch's columns)."""

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
    extras: dict[str, Any] | None = None  # once-per-request payloads (prompt log-probs, embeddings)


# the UserReply fields a ReplyBatch carries only on the rows that have them
_RARE = ("finished", "finish_reason", "prompt_tokens", "completion_tokens", "logprobs", "error")
_RARE += ("error_param", "cached_tokens", "extras")


@serializable
@dataclass
class ReplyBatch:
    """Detokenizer -> API server: the replies of one or more scheduler steps, as columns: row i is request
    `uids[i]`'s new `texts[i]` and `token_ids[i]`; `info[i]` holds the row's other UserReply fields, only
    on rows that have any (a request's first and last, errors, log-probs)."""

    uids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    info: dict[int, dict[str, Any]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.uids)

    def add(self, reply: UserReply) -> None:
        i = len(self.uids)
        self.uids.append(reply.uid)
        self.texts.append(reply.text)
        self.token_ids.append(reply.token_ids)
        info = {k: v for k in _RARE if (v := getattr(reply, k))}
        if info:
            self.info[i] = info

    def extend(self, other: ReplyBatch) -> None:
        n = len(self.uids)
        self.uids += other.uids
        self.texts += other.texts
        self.token_ids += other.token_ids
        self.info.update({n + i: v for i, v in other.info.items()})

    def split(self, k: int) -> list[ReplyBatch]:
        """The rows for each of k API servers: server i owns the uids equal to i modulo k."""
        if k == 1:
            return [self]
        parts = [ReplyBatch() for _ in range(k)]
        for i, uid in enumerate(self.uids):
            part = parts[uid % k]
            if i in self.info:
                part.info[len(part.uids)] = self.info[i]
            part.uids.append(uid)
            part.texts.append(self.texts[i])
            part.token_ids.append(self.token_ids[i])
        return parts

    def replies(self) -> list[UserReply]:
        """The rows as UserReply objects, in order."""
        out = []
        for i, (uid, text, ids) in enumerate(zip(self.uids, self.texts, self.token_ids)):
            info = self.info.get(i)
            out.append(UserReply(uid, text, ids) if info is None else UserReply(uid, text, ids, **info))
        return out

    @classmethod
    def of(cls, replies: list[UserReply]) -> ReplyBatch:
        batch = cls()
        for r in replies:
            batch.add(r)
        return batch
