"""The endpoints a router in front of several replicas calls on each of them (SGLang's router, `sglang-router`,
and gateways that read the same shapes): its server and model information, a readiness probe that runs a
one-token generation, and the replica's load. The generation endpoints it forwards are the ones in routes.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import minisgl

from .errors import APIError

if TYPE_CHECKING:
    from .server import OpenAIServer

# the readiness probe's request: one token of any vocabulary, one greedy token out
HEALTH_GENERATE = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}


def server_info(server: OpenAIServer) -> dict[str, Any]:
    """SGLang's /get_server_info: the server's arguments under SGLang's names (a replica is one data-parallel
    rank: `dp_size` 1) and its live state."""
    a, stats = server.args, server.frontend.stats
    return {
        "model_path": a.model_path,
        "tokenizer_path": a.model_path,
        "served_model_name": a.model_name,
        "host": a.host,
        "port": a.port,
        "tp_size": a.tp_size,
        "dp_size": 1,
        "page_size": a.page_size,
        "context_length": server.max_seq_len,
        "max_running_requests": a.max_running_req,
        "api_server_count": a.api_server_count,
        "api_server_index": server.index,  # which of them answered
        "max_total_num_tokens": int(stats.get("kv_total_pages", 0)) * a.page_size,
        "version": minisgl.__version__,
        "internal_states": [
            {
                "num_running_reqs": int(stats.get("num_running", 0)),
                "num_waiting_reqs": int(stats.get("num_waiting", 0)),
            }
        ],
    }


def model_info(server: OpenAIServer) -> dict[str, Any]:
    """SGLang's /get_model_info: what the router reads to register the replica's model (and its tokenizer,
    which it loads from `tokenizer_path` when that is a local directory)."""
    a = server.args
    return {
        "model_path": a.model_path,
        "tokenizer_path": a.model_path,
        "served_model_name": a.model_name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "max_context_length": server.max_seq_len,
        "supports_vision": False,
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }


def load(server: OpenAIServer) -> list[dict[str, Any]]:
    """SGLang's /get_load, one entry per data-parallel rank (one here): requests and KV tokens in use."""
    stats = server.frontend.stats
    return [
        {
            "dp_rank": 0,
            "num_reqs": int(stats.get("num_running", 0) + stats.get("num_waiting", 0)),
            "num_waiting_reqs": int(stats.get("num_waiting", 0)),
            "num_tokens": int(stats.get("kv_used_pages", 0) - stats.get("kv_cached_pages", 0))
            * server.args.page_size,
        }
    ]


def add_worker_routes(app: FastAPI, server: OpenAIServer) -> None:
    """Register the router-facing endpoints (SGLang's paths, and the short ones newer routers call)."""

    async def get_server_info() -> dict[str, Any]:
        return server_info(server)

    async def get_model_info() -> dict[str, Any]:
        return model_info(server)

    for path in ("/get_server_info", "/server_info"):
        app.get(path)(get_server_info)
    for path in ("/get_model_info", "/model_info"):
        app.get(path)(get_model_info)

    add_cache_routes(app, server)

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        return load(server)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        # readiness, not liveness: the whole path (tokenizer side, scheduler, a forward step) answers
        if not server.health():
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        try:
            reply = await server.generate(request, dict(HEALTH_GENERATE))
            ok = reply.status_code == 200
        except APIError:  # e.g. HTTP 429: too many requests wait, so the replica is not ready for more
            ok = False
        return JSONResponse({"status": "ok" if ok else "unhealthy"}, status_code=200 if ok else 503)


FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


def add_cache_routes(app: FastAPI, server: OpenAIServer) -> None:
    """SGLang's /flush_cache, which the router calls on every replica: empties the prefix cache (the
    scheduler does it only while idle, and logs whether it did); answered at once, as SGLang does."""

    async def flush_cache() -> Response:
        server.frontend.flush_cache()
        return PlainTextResponse(FLUSHED)

    app.api_route("/flush_cache", methods=["GET", "POST"])(flush_cache)


class RequestIdMiddleware:
    """Answer with the request id header the client (or a router) sent, so a reply can be matched to the
    request across the router's logs and the replica's; pure ASGI, so streaming and disconnects pass."""

    HEADERS = (b"x-request-id", b"x-correlation-id", b"x-trace-id")

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        echo = [(k, v) for k, v in scope["headers"] if k in self.HEADERS]
        if not echo:
            return await self.app(scope, receive, send)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", []), *echo])
            await send(message)

        return await self.app(scope, receive, send_with_id)
