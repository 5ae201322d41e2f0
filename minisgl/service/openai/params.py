"""A request body -> SamplingParams, stop strings, n and the prompts.

Only what is HTTP's own is decided here (defaults, `n`, splitting `stop` into strings and token ids,
top_k 0 meaning no limit, `logit_bias` keys, the shapes of prompts and messages, and the limits that
keep one request from taking the service: `Limits`); the rules on the values are SamplingParams.validate's
and the Scheduler's, the same as the offline path's.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from minisgl.core import InvalidRequest, SamplingParams
from minisgl.message import TokenizeMsg

from .errors import APIError, FieldNames
from .protocol import MAX_LOGIT_BIAS, ChatMessage, SamplingBody, ToolCall

if TYPE_CHECKING:
    from ..args import ServerArgs

MAX_N = 128  # choices per request
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
# A token of any tokenizer seen holds at most a few dozen bytes of text (long runs of spaces or of "="),
# so a prompt of more than context x 32 bytes cannot fit the context: it is refused before it is tokenized
# (tokenizing megabytes would hold the tokenizer worker for seconds, and every stream with it)
BYTES_PER_TOKEN = 32
MAX_STOP = 16  # stop strings per request: the detokenizer looks for each after every token
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, from the options and the context length."""

    max_prompt_bytes: int  # UTF-8 bytes of one text prompt, or of a chat's message contents together
    context: int  # tokens; also the most messages of a chat (each takes at least one token)
    max_sequences: int  # prompts x n

    @property
    def max_items(self) -> int:
        """The longest list or object a body may hold. Token ids and messages take a token each, so 4 x the
        context is far more than can fit; the exact limits answer later, with their own messages."""
        return max(4 * self.context, self.max_sequences, MAX_LOGIT_BIAS)

    @classmethod
    def of(cls, args: ServerArgs, max_seq_len: int) -> Limits:
        context = max(max_seq_len, 1)
        return cls(context * BYTES_PER_TOKEN, context, args.max_sequences_per_request)

    def check_text(self, text: str, param: str) -> None:
        """Refuse a text that cannot fit the context, before anything tokenizes it."""
        if 4 * len(text) <= self.max_prompt_bytes:  # a character is at most 4 bytes: no need to encode
            return
        size = len(text.encode("utf-8"))
        if size > self.max_prompt_bytes:
            raise APIError(
                f"'{param}' has {size} bytes of text; at most {self.max_prompt_bytes} can fit the context "
                f"of {self.context} tokens",
                param,
                "context_length_exceeded",
            )

    def check_sequences(self, num_prompts: int, n: int, prompt: str = "prompt") -> None:
        """prompts x n within --max-sequences-per-request (400 naming `n`, or the prompt when n is 1)."""
        if num_prompts * n > self.max_sequences:
            param = "n" if n > 1 else prompt
            raise APIError(
                f"the request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} sequences; "
                f"the limit is {self.max_sequences} (--max-sequences-per-request)",
                param,
                "invalid_value",
            )


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
        # wrapped into 64 bits: seed 2**63 - 1 with n > 1 still travels (msgpack carries 64-bit ints)
        seed = None if p.seed is None else (p.seed + i + 2**63) % 2**64 - 2**63
        return dataclasses.replace(p, seed=seed, stop_token_ids=list(p.stop_token_ids))


def sampling(
    req: SamplingBody,
    max_tokens: int | None,
    names: FieldNames,
    logprobs: bool,
    top_logprobs: int,
    prompt_logprobs: int | None = None,
    prompt_logprobs_start: int = 0,
) -> Sampling:
    """The SamplingParams of a body (no `max_tokens`: up to the context), checked by the shared rules;
    `prompt_logprobs`: the prompt's own log-probabilities (and top k) from `prompt_logprobs_start` on."""
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    _check_stops(stops, req.stop_token_ids or [])
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_k=-1 if req.top_k in (None, 0) else req.top_k,
        top_p=1.0 if req.top_p is None else float(req.top_p),
        min_p=_real(req.min_p, 0.0),
        max_tokens=max_tokens,
        ignore_eos=bool(req.ignore_eos),
        seed=req.seed,
        stop_token_ids=[s for s in stops if isinstance(s, int)] + list(req.stop_token_ids or []),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        frequency_penalty=_real(req.frequency_penalty, 0.0),
        presence_penalty=_real(req.presence_penalty, 0.0),
        repetition_penalty=_real(req.repetition_penalty, 1.0),
        logit_bias=logit_bias(req.logit_bias),
        prompt_logprobs=prompt_logprobs,
        prompt_logprobs_start=prompt_logprobs_start,
    )
    try:
        params.validate()
    except InvalidRequest as e:
        raise names.error(e.message, e.param) from None
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise APIError(f"'n' must be in [1, {MAX_N}], got {n}", "n", "invalid_value")
    return Sampling(params, [s for s in stops if isinstance(s, str) and s], n)


def _real(value: float | None, default: float) -> float:
    return default if value is None else float(value)


def _check_stops(stops: list[str | int], stop_token_ids: list[int]) -> None:
    strings = [s for s in stops if isinstance(s, str)]
    if len(strings) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in strings):
        raise APIError(
            f"'stop' may hold at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters",
            "stop",
            "invalid_value",
        )
    if len(stops) - len(strings) + len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise APIError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids", "stop", "invalid_value")


_TOKEN_KEY = re.compile(r"[0-9]{1,10}")  # JSON keys are strings: a token id in decimal digits


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """`logit_bias` with its keys as token ids (the values are SamplingParams.validate's to check)."""
    if not bias:
        return None
    if len(bias) > MAX_LOGIT_BIAS:
        raise APIError(
            f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}",
            "logit_bias",
            "invalid_value",
        )
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not _TOKEN_KEY.fullmatch(key):
            raise APIError(
                f"'logit_bias' keys must be token ids (decimal digits), got {key[:32]!r}",
                "logit_bias",
                "invalid_value",
            )
        out[int(key)] = value
    return out


def chat_messages(messages: list[ChatMessage], limits: Limits) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (text parts joined, `developer` read as `system`, an
    assistant's `tool_calls` with their arguments as objects, as the templates expect)."""
    if not messages:
        raise APIError("'messages' must not be empty", "messages", "invalid_value")
    if len(messages) > limits.context:
        raise APIError(
            f"'messages' holds {len(messages)} messages; at most {limits.context} can fit the context",
            "messages",
            "context_length_exceeded",
        )
    out = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise APIError(
                f"messages[{i}].role must be system, user, assistant, tool or developer, got {m.role!r}",
                f"messages[{i}].role",
                "invalid_value",
            )
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            # as OpenAI: only an assistant message that calls tools may leave its content out
            raise APIError(
                f"'messages[{i}].content' is required in a {m.role} message"
                + (" without tool_calls" if m.role == "assistant" else ""),
                f"messages[{i}].content",
                "missing_required_parameter",
            )
        if m.role == "tool" and m.tool_call_id is None:
            raise APIError(
                f"'messages[{i}].tool_call_id' is required in a tool message (the id of the call it answers)",
                f"messages[{i}].tool_call_id",
                "missing_required_parameter",
            )
        if isinstance(m.content, list):
            if any(p.type != "text" or p.text is None for p in m.content):
                raise APIError(
                    "only text content parts are supported", f"messages[{i}].content", "invalid_value"
                )
            content = "".join(p.text or "" for p in m.content)
        else:
            content = m.content or ""
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.tool_calls:
            msg["tool_calls"] = _tool_calls(m.tool_calls, i)
        if m.role == "tool" and m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    calls = "".join(c.function.arguments for m in messages for c in m.tool_calls or [])
    limits.check_text("".join(m["content"] for m in out) + calls, "messages")  # the template adds little
    return out


def _tool_calls(calls: list[ToolCall], i: int) -> list[dict[str, Any]]:
    """An assistant's calls for the template: `arguments` parsed (the templates write them with tojson)."""
    out = []
    for j, c in enumerate(calls):
        try:
            args = json.loads(c.function.arguments)
        except ValueError:
            args = None
        if not isinstance(args, dict):
            param = f"messages[{i}].tool_calls"
            raise APIError(f"'{param}[{j}].function.arguments' must be a JSON object", param, "invalid_value")
        call = {"type": "function", "function": {"name": c.function.name, "arguments": args}}
        out.append(dict(call, id=c.id) if c.id is not None else call)
    return out


# apply_chat_template's own arguments: `chat_template_kwargs` may not set them
_TEMPLATE_ARGS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt"}
_TEMPLATE_ARGS |= {"continue_final_message", "tokenize", "padding", "truncation", "max_length"}
_TEMPLATE_ARGS |= {"return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """`chat_template_kwargs` (e.g. {"enable_thinking": false}): variables the chat template reads; the
    names of apply_chat_template's own arguments are refused."""
    if not kwargs:
        return None
    taken = sorted(k for k in kwargs if k in _TEMPLATE_ARGS or not k.isidentifier())
    if taken:
        raise APIError(
            f"'chat_template_kwargs' may not set {taken[0]!r} (only variables the chat template reads)",
            "chat_template_kwargs",
            "invalid_value",
        )
    return dict(kwargs)


def chat_fan_out(
    messages: list[dict[str, Any]],
    s: Sampling,
    limits: Limits,
    tools: list[dict[str, Any]] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> list[TokenizeMsg]:
    """One TokenizeMsg per choice of a chat (`tools`: for a template that renders them; `kwargs`: the
    template's other variables)."""
    limits.check_sequences(1, s.n)
    return [
        TokenizeMsg(
            -1, s.for_choice(i), messages=messages, stop=s.stop, tools=tools, chat_template_kwargs=kwargs
        )
        for i in range(s.n)
    ]


def prompts(value: Any, param: str, limits: Limits) -> list[Prompt]:
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
    limits.check_sequences(len(items), 1, param)
    out: list[Prompt] = []
    for item in items:
        if not item:
            raise APIError(
                f"'{param}' must not be empty (nor contain an empty prompt)", param, "invalid_value"
            )
        if isinstance(item, str):
            limits.check_text(item, param)
        out.append((item, None) if isinstance(item, str) else (None, list(item)))
    return out


def fan_out(
    prompt_list: list[Prompt], s: Sampling, limits: Limits, max_tokens_auto: bool = False
) -> tuple[list[TokenizeMsg], list[int]]:
    """One TokenizeMsg per (prompt, choice), prompt-major, and the prompt index of each; max_tokens_auto:
    s's max_tokens is only a ceiling (a prompt too long for it runs up to the context)."""
    limits.check_sequences(len(prompt_list), s.n)
    msgs: list[TokenizeMsg] = []
    index: list[int] = []
    for p, (text, ids) in enumerate(prompt_list):
        for i in range(s.n):
            msgs.append(
                TokenizeMsg(
                    -1,
                    s.for_choice(i),
                    text=text,
                    input_ids=ids,
                    stop=s.stop,
                    max_tokens_auto=max_tokens_auto,
                )
            )
            index.append(p)
    return msgs, index
