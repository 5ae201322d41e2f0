"""The request bodies (strict pydantic models), reading a body, and what a field must be when it is wrong."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import APIError


class _Body(BaseModel):
    # strict: "5" is not an integer and true is not a number; unknown OpenAI fields are accepted and ignored
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Body):
    """`stream_options`: only `include_usage` is read."""

    include_usage: bool | None = None


class SamplingBody(_Body):
    """The sampling fields shared by chat, completions and /generate's `sampling_params`."""

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

    @property
    def include_usage(self) -> bool:
        """A final usage chunk was asked for (streaming only)."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ContentPart(_Body):
    """One part of a message's content; only text parts are supported."""

    type: str
    text: str | None = None


class ChatMessage(_Body):
    """One chat message."""

    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(SamplingBody):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(SamplingBody):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None


class GenerateRequest(_Body):
    """POST /generate (SGLang's native shape)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: bool | None = None


TYPE_HINTS = {  # what a field must be, for the error message
    "messages": "a list of {role, content} objects",
    "role": "a string",
    "content": "a string or a list of {type: text, text} parts",
    "prompt": "a string, a list of token ids, a list of strings or a list of token-id lists",
    "stop": "a string or a list of strings / token ids",
    "text": "a string or a list of strings",
    "input_ids": "a list of token ids or a list of token-id lists",
}


def validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as an APIError naming the field (`messages[2].content` for a message)."""
    err = e.errors()[0]
    loc = list(err["loc"])
    param = str(loc[0]) if loc else None
    if param == "messages" and len(loc) > 1 and isinstance(loc[1], int):
        param += f"[{loc[1]}]" + (f".{loc[2]}" if len(loc) > 2 and isinstance(loc[2], str) else "")
    if err["type"] == "missing":
        return APIError(f"'{param}' is required", param, "missing_required_parameter")
    field_name = param.rsplit(".", 1)[-1] if param else ""
    hint = TYPE_HINTS.get(field_name)
    msg = f"'{param}' must be {hint}" if hint else f"invalid '{param}': {err['msg']}"
    return APIError(msg, param, "invalid_type")


async def read_json(request: Request, limit: int) -> dict[str, Any]:
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


def parse(model: type[BaseModel], data: dict[str, Any]) -> Any:
    """`data` as a `model`, or the APIError naming the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
