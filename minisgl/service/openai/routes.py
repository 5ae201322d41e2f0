"""The FastAPI application: its middleware, its routes (the handlers are server.py's) and its error
handlers."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from ..args import ServerArgs
from .auth import APIKeyMiddleware
from .browsers import LocalOnly, LocalOnlyMiddleware
from .chat_page import chat_page
from .draining import Drain, DrainMiddleware
from .errors import (
    SERVER_ERROR,
    error_object,
    error_response,
    model_not_found,
)
from .server import OpenAIServer
from .worker_api import RequestIdMiddleware, add_worker_routes


def create_app(
    args: ServerArgs, max_seq_len: int = 0, health: Callable[[], bool] = lambda: True, index: int = 0
) -> FastAPI:
    """The FastAPI application of API server `index`. `health` tells /health whether every worker process
    is alive."""
    server = OpenAIServer(args, max_seq_len, health, index)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.start()
        # what exists now (the app, the libraries) lives as long as the process: the cyclic collector need
        # not walk it again on every collection the per-token objects trigger
        gc.freeze()
        yield
        server.stop()

    app = FastAPI(title="minisgl", lifespan=lifespan)
    add_error_handlers(app)
    if args.api_key:
        app.add_middleware(APIKeyMiddleware, key=args.api_key)
    else:  # no key: web pages and DNS-rebinding pages are kept out instead
        policy = LocalOnly(args.host, args.allowed_hosts, args.allowed_origins)
        app.add_middleware(LocalOnlyMiddleware, policy=policy)
    drain = Drain(args.shutdown_timeout)
    app.add_middleware(DrainMiddleware, drain=drain)
    app.add_middleware(RequestIdMiddleware)  # outermost: a refused request's reply carries its id too

    async def stop_gracefully() -> None:  # on SIGTERM (service/launch.py)
        await drain.run(lambda: len(server.frontend.queues), server.frontend.end_all)

    app.state.stop_gracefully = stop_gracefully
    add_worker_routes(app, server)

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return chat_page()

    @app.get("/v1/models")
    async def v1_models() -> dict[str, Any]:
        return server.v1_models()

    @app.get("/v1/models/{name:path}")
    async def v1_model(name: str) -> Response:
        if name not in args.model_names:
            return server.refuse(model_not_found(name))
        return JSONResponse(server.model_card(name))

    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with either
    async def health_check() -> Response:
        ok = server.health()
        return JSONResponse({"status": "ok" if ok else "unhealthy"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.frontend.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def guarded(handler: Callable[[Request, dict[str, Any]], Awaitable[Response]]) -> Any:
        async def endpoint(request: Request) -> Response:
            return await server.guarded(request, handler)

        return endpoint

    for path, handler in (  # the endpoints that take a JSON body: read and refused alike
        ("/v1/chat/completions", server.chat),
        ("/v1/responses", server.responses),
        ("/v1/completions", server.completions),
        ("/generate", server.generate),
        ("/v1/embeddings", server.embeddings),
        ("/tokenize", server.tokenize),
        ("/detokenize", server.detokenize),
    ):
        app.post(path, name=path.strip("/").replace("/", "_"))(guarded(handler))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        return JSONResponse(await server.tokenizer.info(server.max_seq_len))

    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error status answers an OpenAI error object: starlette's own (404 unknown route, 405 wrong
    method), FastAPI's validation of typed parameters (400, as OpenAI answers a bad request), and any
    exception a handler did not expect (500; uvicorn logs its traceback and the server keeps serving)."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:
        if e.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"  # OpenAI's words
        elif e.status_code == 405:
            message = f"Method {request.method} is not allowed for {request.url.path}"
        else:
            message = str(e.detail)
        return error_response(e.status_code, message, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> Response:
        first = (e.errors() or [{}])[0]
        loc = [str(part) for part in first.get("loc", ())]
        param = loc[-1] if loc else None  # loc[0] says where: "query", "path", "body"
        message = f"invalid '{'.'.join(loc)}': {first.get('msg', 'invalid request')}"
        return JSONResponse(error_object(message, param, "invalid_value"), status_code=400)

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception) -> Response:
        return error_response(500, SERVER_ERROR, kind="server_error")
