"""`--api-key`: every request but /health and the chat page must carry `Authorization: Bearer <key>`, or
gets OpenAI's 401."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_response

# liveness probes carry no credentials; the chat page (static, no data) asks for the key and sends it itself
OPEN_PATHS = frozenset({"/health", "/"})

MISSING_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header using "
    "Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
WRONG_KEY = "Incorrect API key provided. Pass the server's --api-key as `Authorization: Bearer <key>`."


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the request's `Authorization: Bearer <token>` header, or None when there is none."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return None


class APIKeyMiddleware:
    """A plain ASGI middleware (not BaseHTTPMiddleware, which would sit between a stream and its client and
    hide disconnects) answering 401 before any route runs, unknown routes included, as OpenAI does."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope["headers"])
        # compare_digest takes as long for a wrong key as for a right one: no timing leak of the key
        if token is not None and hmac.compare_digest(token, self.key):
            await self.app(scope, receive, send)
            return
        message = MISSING_KEY if not token else WRONG_KEY
        response = error_response(401, message, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
