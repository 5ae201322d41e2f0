"""Errors a client can cause, as OpenAI error objects, and each endpoint's names for the request fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from minisgl.core import GRAMMAR_FIELDS, InvalidRequest


def error_object(
    message: str, param: str | None, code: str | None, kind: str = "invalid_request_error"
) -> dict[str, Any]:
    """The body of an OpenAI error (also sent as an SSE event when a stream fails midway); `kind` is its
    `type`: `invalid_request_error` for the client's mistakes, `server_error` for ours."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    code: str | None = None,
    kind: str = "invalid_request_error",
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An OpenAI error object with its HTTP status (the app's handlers for 401, 404, 405, 500, ...)."""
    return JSONResponse(error_object(message, None, code, kind), status_code=status, headers=headers)


SERVER_ERROR = "The server had an error while processing your request. Sorry about that!"  # OpenAI's words


class APIError(Exception):
    """A client mistake: HTTP 400 (or `status`) with an OpenAI-style error object naming the field."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status
        self.type, self.headers = type, headers

    def response(self) -> JSONResponse:
        body = error_object(self.message, self.param, self.code, self.type)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


RETRY_AFTER_S = 1  # what an overloaded service asks a client to wait


def overloaded(waiting: int, limit: int) -> APIError:
    """HTTP 429 as OpenAI answers a rate limit, with `Retry-After`: too many sequences wait already."""
    return APIError(
        f"the service is overloaded: {waiting} sequences would wait to run, more than "
        f"{limit} (--max-waiting-requests); retry after {RETRY_AFTER_S} s",
        None,
        "rate_limit_exceeded",
        status=429,
        type="requests",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def model_not_found(name: str) -> APIError:
    """OpenAI's answer to a model name the server does not serve (HTTP 404)."""
    message = f"The model `{name}` does not exist or you do not have access to it."
    return APIError(message, None, "model_not_found", status=404)


class ClientGone(Exception):
    """The HTTP client disconnected while its request was generating."""


@dataclass(frozen=True)
class FieldNames:
    """How one endpoint spells the generic field names an InvalidRequest carries (`prompt`, `max_tokens`,
    `stop_token_ids`); the other names (`temperature`, `top_p`, ...) are the same everywhere."""

    prompt: str  # "messages" | "prompt" | "text" | "input_ids"
    max_tokens: str = "max_tokens"  # or "max_completion_tokens" / "max_new_tokens"
    constraint: str | None = None  # the request field its constraint came from (`response_format`, ...)

    def of(self, param: str | None) -> str | None:
        """The endpoint's name for a generic field name."""
        # stop token ids come from `stop` (ints in it) and `stop_token_ids` together: `stop` names both
        names = {"prompt": self.prompt, "max_tokens": self.max_tokens, "stop_token_ids": "stop"}
        if self.constraint is not None:  # the grammar checks name the SamplingParams field
            names.update(dict.fromkeys(GRAMMAR_FIELDS, self.constraint))
        return names.get(param, param) if param is not None else None

    def error(self, message: str, param: str | None) -> APIError:
        """The HTTP 400 for a request the shared rules (SamplingParams, Scheduler) rejected."""
        name = self.of(param)
        return APIError(InvalidRequest.renamed(message, param, name), name, "invalid_value")
