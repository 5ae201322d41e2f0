"""A request body -> SamplingParams, stop strings, n and the prompts.

Only what is HTTP's own is decided here (defaults, `n`, splitting `stop` into strings and token ids,
top_k 0 meaning no limit, the shapes of prompts and messages); the rules on the values are
SamplingParams.validate's and the Scheduler's, the same as the offline path's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from minisgl.core import InvalidRequest, SamplingParams
from minisgl.message import TokenizeMsg

from .errors import APIError, FieldNames
from .protocol import ChatCompletionRequest, SamplingBody

MAX_N = 128  # choices per request
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")

Prompt = tuple[str | None, list[int] | None]  # (text, input_ids): exactly one is set


@dataclass
class Sampling:
    """The sampling part of one request: n choices of `params`, cut at the `stop` strings."""

    params: SamplingParams
    stop: list[str]
    n: int

    def for_choice(self, i: int) -> SamplingParams:
        """Choice i of n: its own seed (seed + i), so the choices differ yet are reproducible."""
        p = self.params
        seed = None if p.seed is None else p.seed + i
        return dataclasses.replace(p, seed=seed, stop_token_ids=list(p.stop_token_ids))


def sampling(
    req: SamplingBody, max_tokens: int | None, names: FieldNames, logprobs: bool, top_logprobs: int
) -> Sampling:
    """The SamplingParams of a body (no `max_tokens`: up to the context), checked by the shared rules."""
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_k=-1 if req.top_k in (None, 0) else req.top_k,
        top_p=1.0 if req.top_p is None else float(req.top_p),
        max_tokens=max_tokens,
        ignore_eos=bool(req.ignore_eos),
        seed=req.seed,
        stop_token_ids=[s for s in stops if isinstance(s, int)] + list(req.stop_token_ids or []),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    try:
        params.validate()
    except InvalidRequest as e:
        raise names.error(e.message, e.param) from None
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise APIError(f"'n' must be in [1, {MAX_N}], got {n}", "n", "invalid_value")
    return Sampling(params, [s for s in stops if isinstance(s, str) and s], n)


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as the chat template takes them (text parts joined, `developer` read as `system`)."""
    if not req.messages:
        raise APIError("'messages' must not be empty", "messages", "invalid_value")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
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


def prompts(value: Any, param: str) -> list[Prompt]:
    """A string, token ids, or a list of either -> a list of prompts (the token ids are the Scheduler's
    to check)."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif value and all(isinstance(t, int) for t in value):
        items = [value]
    else:
        items = list(value)
    if not items:
        raise APIError(f"'{param}' must not be empty", param, "invalid_value")
    out: list[Prompt] = []
    for item in items:
        if not item:
            raise APIError(
                f"'{param}' must not be empty (nor contain an empty prompt)", param, "invalid_value"
            )
        out.append((item, None) if isinstance(item, str) else (None, list(item)))
    return out


def fan_out(prompt_list: list[Prompt], s: Sampling) -> tuple[list[TokenizeMsg], list[int]]:
    """One TokenizeMsg per (prompt, choice), prompt-major, and the prompt index of each."""
    msgs: list[TokenizeMsg] = []
    index: list[int] = []
    for p, (text, ids) in enumerate(prompt_list):
        for i in range(s.n):
            msgs.append(TokenizeMsg(-1, s.for_choice(i), text=text, input_ids=ids, stop=s.stop))
            index.append(p)
    return msgs, index
