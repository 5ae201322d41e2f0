"""The request bodies (strict pydantic models), reading a body, and what a field must be when it is wrong.

Everything a client sends is bounded here before anything else looks at it: the body's size, its JSON
nesting depth, its strings (valid UTF-8: no lone surrogates), every integer (64 bits, what the messages
between the processes carry), and the OpenAI fields this server does not implement (HTTP 400 naming
the field, code `unsupported_parameter`; see UNSUPPORTED).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import APIError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# every integer of a body: msgpack carries at most 64 bits, and the rules on the values (SamplingParams,
# the Scheduler) then see a plain int; a token id is checked against the vocabulary by the tokenizer worker
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
MAX_JSON_DEPTH = 32  # the deepest real body (chat content parts) nests 5 levels
MAX_LOGIT_BIAS = 300  # entries of `logit_bias` (OpenAI's own limit)


class _Body(BaseModel):
    # strict: "5" is not an integer and true is not a number; unknown fields are accepted and ignored, but
    # OpenAI fields this server does not implement are refused (UNSUPPORTED, checked by `parse`)
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Body):
    """`stream_options`: only `include_usage` is read."""

    include_usage: bool | None = None


class SamplingBody(_Body):
    """The sampling fields shared by chat, completions and /generate's `sampling_params`."""

    model: str | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None  # vLLM's and SGLang's extension
    n: Int64 | None = None
    stop: str | list[str | Int64] | None = None
    stop_token_ids: list[Int64] | None = None
    seed: Int64 | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> bias
    # constrained decoding, at most one per request: SGLang's fields (a JSON Schema as a string or an
    # object, a regex, an EBNF grammar, an xgrammar structural tag) and vLLM's `guided_*` names for them
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None

    @property
    def include_usage(self) -> bool:
        """A final usage chunk was asked for (streaming only)."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ContentPart(_Body):
    """One part of a message's content; only text parts are supported."""

    type: str
    text: str | None = None


class FunctionCall(_Body):
    """The function of an assistant's tool call: its name and its arguments (a JSON string)."""

    name: str
    arguments: str


class ToolCall(_Body):
    """One tool call of an assistant message."""

    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Body):
    """One chat message; an assistant's may hold `tool_calls`, a `tool` message answers `tool_call_id`."""

    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ResponseFormat(_Body):
    """`response_format`: text, json_object, json_schema ({name, schema, strict}) or structural_tag."""

    type: str
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingBody):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = None
    top_logprobs: Int64 | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None  # checked by tools.py, naming the bad part
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # the template's variables, e.g. enable_thinking


class CompletionRequest(SamplingBody):
    """POST /v1/completions."""

    prompt: str | list[Int64] | list[str] | list[list[Int64]]
    logprobs: Int64 | None = None
    echo: bool | None = None  # the prompt first in `text` (and its tokens first in `logprobs`)
    prompt_logprobs: Int64 | None = None  # vLLM's: the prompt's log-probabilities and top k per position
    response_format: ResponseFormat | None = None


class GenerateRequest(_Body):
    """POST /generate (SGLang's native shape). A top-level `max_tokens` (or `max_new_tokens`) is read as
    `sampling_params.max_new_tokens` when that is not given."""

    text: str | list[str] | None = None
    input_ids: list[Int64] | list[list[Int64]] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: bool | None = None
    max_tokens: Int64 | None = None
    max_new_tokens: Int64 | None = None
    # SGLang's log-probabilities: of the output tokens (and, from prompt position `logprob_start_len` when
    # it is >= 0, of the prompt's), with the top `top_logprobs_num` and, asked for, the tokens' texts
    return_logprob: bool = False
    logprob_start_len: Int64 = -1
    top_logprobs_num: Int64 = 0
    return_text_in_logprobs: bool = False

    @model_validator(mode="after")
    def _top_level_max_tokens(self) -> GenerateRequest:
        top = self.max_new_tokens if self.max_new_tokens is not None else self.max_tokens
        sp = dict(self.sampling_params or {})
        inner = sp.get("max_new_tokens")  # an extra field of SamplingBody: bounded here
        if isinstance(inner, int) and not INT64_MIN <= inner <= INT64_MAX:
            msg = _range_message("max_new_tokens", {"input": inner})
            raise APIError(msg, "max_new_tokens", "invalid_value")  # not a ValueError: pydantic passes it on
        if top is not None and sp.get("max_new_tokens", sp.get("max_tokens")) is None:
            sp["max_new_tokens"] = top
            self.sampling_params = sp
        return self


TYPE_HINTS = {  # what a field must be, for the error message
    "messages": "a list of {role, content} objects",
    "role": "a string",
    "content": "a string or a list of {type: text, text} parts",
    "prompt": "a string, a list of token ids, a list of strings or a list of token-id lists",
    "stop": "a string or a list of strings / token ids",
    "text": "a string or a list of strings",
    "input_ids": "a list of token ids or a list of token-id lists",
    "logit_bias": "an object mapping token ids to numbers",
    "response_format": "an object {type: text | json_object | json_schema, ...}",
    "tools": "a list of {type: function, function: {name, description, parameters}} objects",
    "tool_choice": 'one of "auto", "none", "required" or {type: function, function: {name}}',
    "tool_calls": "a list of {id, type: function, function: {name, arguments}} objects",
}


def _is_off(value: Any) -> bool:
    return value is None or value is False or value == "" or value == [] or value == {}


# OpenAI chat / completions fields not implemented here, and the values that mean "not used" (accepted).
# Accepted as no-ops (they change nothing a client can see): user, metadata, store, service_tier,
# prompt_cache_key, safety_identifier, stream_options.include_obfuscation.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda v: v is None or v == 1,  # several candidates ranked by logprob: not implemented
    "suffix": _is_off,  # insertion (fill-in-the-middle)
    "functions": _is_off,  # the deprecated form of `tools`
    "function_call": lambda v: v is None or v == "none",
    "audio": _is_off,
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": _is_off,
    "reasoning_effort": _is_off,
    "verbosity": _is_off,
    "web_search_options": _is_off,
    "min_tokens": lambda v: v is None or v == 0,  # a vLLM extension seen often
}


def check_supported(data: dict[str, Any]) -> None:
    """Refuse a field this server does not implement when it asks for something (HTTP 400 naming it)."""
    for name, is_unused in UNSUPPORTED.items():
        if name in data and not is_unused(data[name]):
            raise APIError(f"'{name}' is not supported by this server", name, "unsupported_parameter")


def _range_message(param: str, err: dict[str, Any]) -> str:
    value = err.get("input")
    return f"'{param}' must be an integer in [{INT64_MIN}, {INT64_MAX}], got {value}"


def validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as an APIError naming the field (`messages[2].content` for a message)."""
    err = e.errors()[0]
    loc = list(err["loc"])
    param = str(loc[0]) if loc else None
    if param == "messages" and len(loc) > 1 and isinstance(loc[1], int):
        param += f"[{loc[1]}]" + (f".{loc[2]}" if len(loc) > 2 and isinstance(loc[2], str) else "")
    if err["type"] == "missing":
        return APIError(f"'{param}' is required", param, "missing_required_parameter")
    if err["type"] in ("greater_than_equal", "less_than_equal"):
        return APIError(_range_message(str(param), err), param, "invalid_value")
    if err["type"] == "value_error":  # a model validator's own message
        return APIError(str(err.get("ctx", {}).get("error", err["msg"])), param, "invalid_value")
    field_name = param.rsplit(".", 1)[-1] if param else ""
    hint = TYPE_HINTS.get(field_name)
    msg = f"'{param}' must be {hint}" if hint else f"invalid '{param}': {err['msg']}"
    return APIError(msg, param, "invalid_type")


async def _read_body(request: Request, limit: int) -> tuple[bytearray, int]:
    """The first `limit` bytes of the body and its whole size (the rest is drained, so the client can
    read the answer)."""
    size = 0
    body = bytearray()
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            body += chunk
    return body, size


def check_content_type(content_type: str | None) -> None:
    """A JSON endpoint takes `application/json` (or `application/<x>+json`), as the openai SDK, `httpx`'s
    `json=` and `curl -H 'Content-Type: application/json'` send it; anything else is HTTP 415. A web page
    can POST text/plain or a form from anywhere without asking; a JSON type it cannot send unasked."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    got = f"got {printable(media)!r}" if media else "none was given"
    raise APIError(
        f"the request body must be JSON with 'Content-Type: application/json'; {got}",
        None,
        "unsupported_media_type",
        status=415,
    )


async def read_json(
    request: Request, limit: int, max_items: int | None = None, timeout: float | None = None
) -> dict[str, Any]:
    """The body as a JSON object (declared so: `check_content_type`); a body over `limit` bytes is
    refused, one not sent whole within `timeout` seconds too (HTTP 408: a half-sent request must not hold
    a connection forever). Nesting, strings and the size of every list and object are bounded
    (`check_json`), before anything costs more than the parse itself."""
    check_content_type(request.headers.get("content-type"))
    try:
        body, size = await asyncio.wait_for(_read_body(request, limit), timeout)
    except asyncio.TimeoutError:
        raise APIError(
            f"the request body did not arrive within {timeout:g} s (--request-timeout)",
            None,
            "request_timeout",
            status=408,
        ) from None
    if size > limit:
        raise APIError(
            f"the request body has {size} bytes; the limit is {limit} (--max-request-bytes)",
            None,
            "request_too_large",
        )
    try:
        text = body.decode("utf-8")  # strict: encoded surrogates are not UTF-8
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    except RecursionError:
        raise APIError(_depth_message(), None, "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object", None, "invalid_json")
    check_json(data, strings=_SURROGATE_ESCAPE.search(text) is not None, max_items=max_items)
    return data


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a \uD800-\uDFFF escape: maybe a lone surrogate


def _depth_message() -> str:
    return f"the request body nests deeper than {MAX_JSON_DEPTH} levels"


def check_json(data: dict[str, Any], strings: bool, max_items: int | None = None) -> None:
    """Bound the nesting depth and (with `max_items`) the length of every list and object; with
    `strings`, also refuse strings that are not valid UTF-8 (a lone surrogate: the messages between the
    processes could not carry it). Iterative: no recursion. A list is measured before it is walked, so
    200,000 chat messages are refused at once, not parsed (pydantic: seconds of the event loop)."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        node, depth, top = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(_depth_message(), top or None, "invalid_json")
        if max_items is not None and len(node) > max_items:
            field = top or None
            raise APIError(
                f"'{field}' holds {len(node)} items; at most {max_items} fit the context",
                field,
                "context_length_exceeded",
            )
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            field = top or printable(str(key))
            if strings and isinstance(key, str):
                _check_utf8(key, field)
            if isinstance(value, (dict, list)):
                stack.append((value, depth + 1, field))
            elif strings and isinstance(value, str):
                _check_utf8(value, field)


def printable(name: str, limit: int = 64) -> str:
    """A field name from the body, safe to put in a reply: a lone surrogate (or any non-ASCII character)
    escaped as \\uXXXX, at most `limit` characters."""
    escaped = name.encode("ascii", "backslashreplace").decode("ascii")
    return escaped if len(escaped) <= limit else escaped[:limit] + "..."


def _check_utf8(s: str, field: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(
            f"'{field}' holds a lone surrogate (\\ud800-\\udfff): not valid UTF-8", field, "invalid_value"
        ) from None


def parse(model: type[BaseModel], data: dict[str, Any]) -> Any:
    """`data` as a `model`, or the APIError naming the first bad field."""
    check_supported(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    except RecursionError:  # pragma: no cover - check_json bounds the depth first
        raise APIError(_depth_message(), None, "invalid_json") from None
