"""The FastAPI application: the routes, and the run / stream logic every generation endpoint shares."""

from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from minisgl.message import TokenizeMsg, UserReply
from minisgl.tokenizer import chat_text
from minisgl.utils import init_logger
from minisgl.utils.hf import load_hf_config

from ..args import ServerArgs
from .auth import APIKeyMiddleware
from .browsers import LocalOnly, LocalOnlyMiddleware
from .chat_page import chat_page
from .constraints import Constraint, requested, single
from .draining import Drain, DrainMiddleware
from .embeddings import EmbeddingRenderer, EmbeddingRequest, embedding_msgs
from .errors import (
    SERVER_ERROR,
    APIError,
    ClientGone,
    FieldNames,
    error_object,
    error_response,
    model_not_found,
)
from .params import (
    Limits,
    Sampling,
    chat_fan_out,
    chat_messages,
    fan_out,
    prompts,
    sampling,
    template_kwargs,
)
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    SamplingBody,
    check_supported,
    parse,
    read_json,
)
from .reasoning import CLOSED, MAY_OPEN, ReasoningFormat, after_reasoning, prompt_state
from .reasoning import detect as detect_reasoning
from .render import SSE_DONE, ChatOutput, ChatRenderer, CompletionRenderer, GenerateRenderer, Renderer, sse
from .responses import ResponsesRenderer, chat_body
from .routing import ChoiceState, FrontendManager, Generation
from .tokenization import DetokenizeBody, ServerTokenizer, TokenizeBody
from .tools import ToolSupport, chat_template_text, detect, template_messages, tool_request, with_tool_grammar
from .worker_api import RequestIdMiddleware, add_worker_routes

logger = init_logger(__name__, "api")

_rids = itertools.count()
MAX_TEMPLATE_STATES = 64  # distinct chat_template_kwargs whose reasoning state is remembered
GENERATE_MAX_NEW_TOKENS = 128  # /generate without max_new_tokens: SGLang's default
COMPLETIONS_MAX_TOKENS = 16  # /v1/completions without max_tokens: OpenAI's default (vLLM's and SGLang's too)


@dataclass
class Job:
    """One HTTP request, translated: its TokenizeMsgs (one per choice) and how to answer."""

    renderer: Renderer
    msgs: list[TokenizeMsg]
    prompt_index: list[int]  # the prompt each choice belongs to
    stream: bool
    names: FieldNames  # the endpoint's names for the fields an error may name


def constrain(s: Sampling, found: list[Constraint], names: FieldNames) -> FieldNames:
    """Put the request's one constraint (checked) on its SamplingParams; the names its errors use."""
    c = single(found)
    if c is None:
        return names
    c.apply(s.params)
    return replace(names, constraint=c.param)


async def parsed(model: type[Any], data: dict[str, Any]) -> Any:
    """`parse` off the event loop: validating a large body takes a while (the loop routes every stream's
    replies meanwhile)."""
    return await asyncio.to_thread(parse, model, data)


def _check(reply: UserReply, names: FieldNames) -> None:
    """A reply that rejects the request becomes the 400 naming the field in the endpoint's words."""
    if reply.error is not None:
        raise names.error(reply.error, reply.error_param)


class OpenAIServer:
    """The handlers; the FrontendManager is made in the app's lifespan (it needs the event loop)."""

    def __init__(self, args: ServerArgs, max_seq_len: int, health: Callable[[], bool]) -> None:
        self.args, self.max_seq_len, self.health = args, max_seq_len, health
        self.created = int(time.time())
        self.limits = Limits.of(args, max_seq_len)
        self.tokenizer = ServerTokenizer(args.model_path, self.limits, args.allow_special_tokens_in_content)
        self._states: dict[str, str] = {}  # chat_template_kwargs (JSON) -> reasoning prompt state
        self._frontend: FrontendManager | None = None

    @functools.cached_property
    def tool_support(self) -> ToolSupport:
        """The served model's tool-call format (read from its chat template on the first request)."""
        support = detect(chat_template_text(self.args.model_path), self.args.tool_call_parser)
        fmt = support.fmt.name if support.fmt is not None else "none"
        logger.info(
            f"tool calls: {fmt} format, {'rendered by' if support.native else 'added to'} the template"
        )
        return support

    @functools.cached_property
    def reasoning_format(self) -> ReasoningFormat | None:
        """The served model's think markers (--reasoning-parser, or found from its chat template)."""
        fmt = detect_reasoning(chat_template_text(self.args.model_path), self.args.reasoning_parser)
        logger.info(f"reasoning: {fmt.name if fmt is not None else 'none'}")
        return fmt

    def reasoning_state(self, kwargs: dict[str, Any] | None) -> str:
        """Where a reply starts with these template variables (reasoning.py's prompt_state), read from the
        generation prompt of a one-message chat; blocking (call it in a thread)."""
        fmt = self.reasoning_format
        assert fmt is not None
        key = json.dumps(kwargs or {}, sort_keys=True)
        if key in self._states:
            return self._states[key]
        try:
            prompt = chat_text(self.tokenizer.get(), [{"role": "user", "content": "?"}], None, kwargs)
        except Exception:  # noqa: BLE001 - the tokenizer worker reports the template's error itself
            return MAY_OPEN
        state = prompt_state(prompt, fmt)
        if len(self._states) < MAX_TEMPLATE_STATES:
            self._states[key] = state
        return state

    @property
    def frontend(self) -> FrontendManager:
        assert self._frontend is not None, "the frontend starts with the app"
        return self._frontend

    def start(self) -> None:
        """Connect to the tokenizer side and start routing replies (needs the running event loop)."""
        self._frontend = FrontendManager(self.args)
        self._frontend.start()

    def stop(self) -> None:
        self.frontend.stop()

    def refuse(self, e: APIError) -> JSONResponse:
        self.frontend.metrics.errors.labels(e.code or "other").inc()
        return e.response()

    async def guarded(
        self, request: Request, handler: Callable[[Request, dict[str, Any]], Awaitable[Response]]
    ) -> Response:
        """Read the body and run `handler`; a client mistake is a 400, a client gone a 499."""
        try:
            data = await read_json(
                request, self.args.max_request_bytes, self.limits.max_items, self.args.request_timeout
            )
            return await handler(request, data)
        except APIError as e:
            return self.refuse(e)
        except ClientGone:
            return Response(status_code=499)

    # ---- shared by every generation endpoint ------------------------------------------------------
    async def run(self, request: Request, job: Job) -> Response:
        """Submit the job's choices, then answer with one JSON body or an SSE stream. A rejected request
        is a plain HTTP 400 even when streaming (the first reply is awaited before the stream opens)."""
        self.frontend.check_capacity(len(job.msgs))  # HTTP 429 when too many sequences wait
        gen = Generation(self.frontend, job.prompt_index)
        for msg, c in zip(job.msgs, gen.choices):
            msg.uid = c.uid
        try:
            await self.frontend.submit(job.msgs)
            if not job.stream:
                while not gen.done:
                    _check((await gen.next(request))[1], job.names)
                await self.tokenizer.warm(job.renderer.token_ids(gen))
                return JSONResponse(job.renderer.full(gen))
            first = await gen.next(request)
            _check(first[1], job.names)
        except APIError as e:
            gen.close()
            return self.refuse(e)
        except BaseException:  # the client went away (or the server is shutting down): abort what runs
            gen.close()
            raise
        return StreamingResponse(
            self._stream(gen, job, first),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def _stream(
        self, gen: Generation, job: Job, first: tuple[ChoiceState, UserReply]
    ) -> AsyncIterator[bytes]:
        """SSE frames; if the client disconnects, starlette cancels this generator and `finally` aborts."""
        r = job.renderer
        try:
            chunks = list(r.stream_start(gen))
            items = [first]
            sent: dict[int, int] = {}  # characters sent per choice (completions' text_offset)
            failed = False
            while True:  # everything that arrived since the last write goes out as one write
                for c, reply in items:
                    if reply.error is not None:  # one prompt of several was rejected
                        name = job.names.of(reply.error_param)
                        chunks.append(sse(error_object(reply.error, name, "invalid_value")))
                        failed = True
                        break
                    chunk = r.stream_delta(c, reply, sent.get(c.index, 0))
                    if chunk is not None:
                        chunks.append(chunk)
                    sent[c.index] = sent.get(c.index, 0) + len(reply.text)
                    if reply.finished and (end := r.stream_finish(c)) is not None:
                        chunks.append(end)
                if failed or gen.done:
                    break
                if chunks:
                    yield b"".join(chunks)
                    chunks = []
                items = await gen.drain()
            if not failed and (usage := r.stream_usage(gen)) is not None:
                chunks.append(usage)
            chunks.append(SSE_DONE)
            yield b"".join(chunks)
        except Exception:  # a bug while streaming: the status is sent already, so the error is an event
            logger.exception("error while streaming a response")
            yield sse(error_object(SERVER_ERROR, None, None, "server_error"))
        finally:
            gen.close()

    # ---- the endpoints -------------------------------------------------------------------------------
    def model_name(self, requested: str | None) -> str:
        """The name a reply reports: the first served name, whichever alias the request used (an absent
        `model` is allowed); a name the server does not serve is OpenAI's 404."""
        if requested is not None and requested not in self.args.model_names:
            raise model_not_found(requested)
        return self.args.model_name

    async def chat(self, request: Request, data: dict[str, Any]) -> Response:
        req: ChatCompletionRequest = await parsed(ChatCompletionRequest, data)
        model = self.model_name(req.model)
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise APIError("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
        msgs, names, output = await self.chat_msgs(req)
        renderer = ChatRenderer(
            model,
            f"chatcmpl-{next(_rids)}",
            include_usage=req.include_usage,
            logprobs=bool(req.logprobs),
            output=output,
        )
        return await self.run(request, Job(renderer, msgs, [0] * len(msgs), bool(req.stream), names))

    async def chat_msgs(
        self, req: ChatCompletionRequest, names: FieldNames | None = None
    ) -> tuple[list[TokenizeMsg], FieldNames, ChatOutput]:
        """A chat request's TokenizeMsgs (one per choice), the names its errors use, and how its output is
        read (reasoning, tool calls); the Responses API comes here too (with its own `names`)."""
        messages = chat_messages(req.messages, self.limits)
        kwargs = template_kwargs(req.chat_template_kwargs)
        use_completion = req.max_completion_tokens is not None
        if names is None:
            names = FieldNames("messages", "max_completion_tokens" if use_completion else "max_tokens")
        max_tokens = req.max_completion_tokens if use_completion else req.max_tokens
        support = self.tool_support
        # off the event loop: each tool's schema is checked, and a string schema parsed, in Python
        tr = await asyncio.to_thread(
            tool_request, req.tools, req.tool_choice, req.parallel_tool_calls, support
        )
        messages, template_tools = template_messages(messages, tr, support)
        s = sampling(req, max_tokens, names, bool(req.logprobs), req.top_logprobs or 0)
        fmt = self.reasoning_format
        state = await asyncio.to_thread(self.reasoning_state, kwargs) if fmt is not None else CLOSED
        found = await asyncio.to_thread(requested, req, req.response_format)
        c = single(with_tool_grammar(found, tr, support))
        c = after_reasoning(c, fmt, state)
        if c is not None:
            c.apply(s.params)
            names = replace(names, constraint=c.param)  # what a grammar's error names
        self.frontend.metrics.requests.labels("chat").inc()
        msgs = chat_fan_out(messages, s, self.limits, template_tools, kwargs)
        tools = support.fmt if tr is not None and tr.parses else None
        return msgs, names, ChatOutput(fmt, state, tools)

    async def responses(self, request: Request, data: dict[str, Any]) -> Response:
        """POST /v1/responses: run as the chat completion it translates to (responses.py)."""
        check_supported(data)
        req: ChatCompletionRequest = await parsed(ChatCompletionRequest, chat_body(data))
        model = self.model_name(req.model)
        msgs, names, output = await self.chat_msgs(req, FieldNames("input", "max_output_tokens"))
        renderer = ResponsesRenderer(model, f"resp_{uuid.uuid4().hex}", request=data, output=output)
        return await self.run(request, Job(renderer, msgs, [0], bool(req.stream), names))

    async def completions(self, request: Request, data: dict[str, Any]) -> Response:
        req: CompletionRequest = await parsed(CompletionRequest, data)
        model = self.model_name(req.model)
        prompt_list = prompts(req.prompt, "prompt", self.limits)
        k = req.logprobs
        if k is not None and not 0 <= k <= 5:
            raise APIError(f"'logprobs' must be in [0, 5], got {k}", "logprobs", "invalid_value")
        echo = bool(req.echo)
        # the prompt's own log-probabilities: vLLM's prompt_logprobs, or echo with logprobs (OpenAI's)
        wanted = [x for x in (req.prompt_logprobs, k if echo else None) if x is not None]
        prompt_k = max(wanted) if wanted else None
        if echo and req.max_tokens == 0 and prompt_k is None:
            prompt_k = 0  # nothing is generated: the request only reads its prompt
        names = FieldNames("prompt")
        auto = req.max_tokens is None  # OpenAI's default: at most 16 tokens, fewer where the context ends
        max_tokens = COMPLETIONS_MAX_TOKENS if auto else req.max_tokens
        s = sampling(req, max_tokens, names, k is not None, k or 0, prompt_logprobs=prompt_k)
        names = constrain(s, await asyncio.to_thread(requested, req, req.response_format), names)
        self.frontend.metrics.requests.labels("completions").inc()
        msgs, index = fan_out(prompt_list, s, self.limits, max_tokens_auto=auto)
        echoed = None
        if echo:  # each prompt's text as given, or its token ids decoded
            echoed = [
                text if text is not None else await self.tokenizer.decode(ids or [])
                for text, ids in prompt_list
            ]
        renderer = CompletionRenderer(
            model,
            f"cmpl-{next(_rids)}",
            include_usage=req.include_usage,
            logprobs=k is not None,
            echo=echoed,
            top=k or 0,
            prompt_logprobs=req.prompt_logprobs is not None,
            piece=self.tokenizer.piece,
        )
        return await self.run(request, Job(renderer, msgs, index, bool(req.stream), names))

    async def generate(self, request: Request, data: dict[str, Any]) -> Response:
        req: GenerateRequest = await parsed(GenerateRequest, data)
        if (req.text is None) == (req.input_ids is None):
            raise APIError("give exactly one of 'text' and 'input_ids'", "text", "invalid_value")
        param = "text" if req.text is not None else "input_ids"
        prompt_list = prompts(req.text if req.text is not None else req.input_ids, param, self.limits)
        sp: SamplingBody = await parsed(SamplingBody, dict(req.sampling_params or {}))
        max_new = (sp.model_extra or {}).get("max_new_tokens", sp.max_tokens)
        if max_new is not None and (not isinstance(max_new, int) or isinstance(max_new, bool)):
            raise APIError("'max_new_tokens' must be an integer", "max_new_tokens", "invalid_type")
        names = FieldNames(param, "max_new_tokens")
        auto = max_new is None  # SGLang's default: at most 128 new tokens, fewer where the context ends
        top, start = req.top_logprobs_num, req.logprob_start_len
        prompt_k = top if req.return_logprob and start >= 0 else None  # SGLang: -1 is the output's only
        max_tokens = GENERATE_MAX_NEW_TOKENS if auto else max_new
        s = sampling(sp, max_tokens, names, req.return_logprob, top, prompt_k, max(start, 0))
        names = constrain(s, await asyncio.to_thread(requested, sp, None), names)
        self.frontend.metrics.requests.labels("generate").inc()
        msgs, index = fan_out(prompt_list, s, self.limits, max_tokens_auto=auto)
        renderer = GenerateRenderer(
            self.args.model_name,
            f"gen-{next(_rids)}",
            logprobs=req.return_logprob,
            input_start=start if prompt_k is not None else None,
            texts=req.return_text_in_logprobs,
            piece=self.tokenizer.piece,
        )
        return await self.run(request, Job(renderer, msgs, index, bool(req.stream), names))

    @functools.cached_property
    def hidden_size(self) -> int:
        """The model's hidden size: the length of its embeddings."""
        config = load_hf_config(self.args.model_path)
        return int(getattr(config, "hidden_size", 0) or config.get_text_config().hidden_size)

    async def embeddings(self, request: Request, data: dict[str, Any]) -> Response:
        """POST /v1/embeddings: one embedding per input, computed beside generation (embeddings.py)."""
        req: EmbeddingRequest = await parsed(EmbeddingRequest, data)
        model = self.model_name(req.model)
        msgs = embedding_msgs(req, self.limits, self.hidden_size)
        self.frontend.metrics.requests.labels("embeddings").inc()
        renderer = EmbeddingRenderer(
            model, f"embd-{next(_rids)}", dimensions=req.dimensions, encoding=req.encoding_format
        )
        return await self.run(
            request, Job(renderer, msgs, list(range(len(msgs))), False, FieldNames("input"))
        )

    async def tokenize(self, request: Request, data: dict[str, Any]) -> Response:
        body: TokenizeBody = await parsed(TokenizeBody, data)
        self.model_name(body.model)
        return JSONResponse(await self.tokenizer.tokenize(body, self.max_seq_len))

    async def detokenize(self, request: Request, data: dict[str, Any]) -> Response:
        body: DetokenizeBody = await parsed(DetokenizeBody, data)
        self.model_name(body.model)
        return JSONResponse(await self.tokenizer.detokenize(body))

    def model_card(self, name: str) -> dict[str, Any]:
        """GET /v1/models/{name}: the card of one served name (an alias has its own card)."""
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "minisgl",
            "root": name,  # vLLM puts the model's path here: a reply must not show the server's files
            "max_model_len": self.max_seq_len,
        }

    def v1_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card(n) for n in self.args.model_names]}


def create_app(args: ServerArgs, max_seq_len: int = 0, health: Callable[[], bool] = lambda: True) -> FastAPI:
    """The FastAPI application. `health` tells /health whether every worker process is alive."""
    server = OpenAIServer(args, max_seq_len, health)

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
