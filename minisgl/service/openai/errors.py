"""Errors a client can cause, as OpenAI error objects, and each endpoint's names for the request fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from minisgl.core import InvalidRequest


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
        self, message: str, param: str | None = None, code: str | None = None, status: int = 400
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def response(self) -> JSONResponse:
        return JSONResponse(error_object(self.message, self.param, self.code), status_code=self.status)


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

    def of(self, param: str | None) -> str | None:
        """The endpoint's name for a generic field name."""
        # stop token ids come from `stop` (ints in it) and `stop_token_ids` together: `stop` names both
        names = {"prompt": self.prompt, "max_tokens": self.max_tokens, "stop_token_ids": "stop"}
        return names.get(param, param) if param is not None else None

    def error(self, message: str, param: str | None) -> APIError:
        """The HTTP 400 for a request the shared rules (SamplingParams, Scheduler) rejected."""
        name = self.of(param)
        return APIError(InvalidRequest.renamed(message, param, name), name, "invalid_value")
