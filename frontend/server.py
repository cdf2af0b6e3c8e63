"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLM, run by uvicorn on uvloop."""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from frontend.anthropic_render import MessagesRenderer, anthropic_error
from frontend.anthropic_requests import MessagesRequest
from frontend.api_errors import APIError, bad_request, from_invalid_param, parse_request, renamed
from frontend.api_params import Job, SamplingRequest, generation_defaults
from frontend.api_render import ChatRenderer, CompletionRenderer
from frontend.async_llm import AsyncLLM
from frontend.chat_prompt import chat_prompt
from frontend.engine_client import EngineClient
from frontend.metrics import Metrics
from frontend.model_resolution import resolve_config
from frontend.openai_requests import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from frontend.responding import ClientGone, respond
from frontend.responses_render import ResponsesRenderer
from frontend.responses_requests import ResponsesRequest
from protocol.config import EngineConfig, InvalidParam
from protocol.grammar import build_grammar

log = logging.getLogger("pico_vllm.server")
MAX_BODY_BYTES = 4 << 20  # a 128k-token prompt is well under 1 MB of text; far larger bodies are abuse
ABORT_MARGIN_S = 0.5  # on SIGTERM, requests still running this long before --shutdown-timeout are aborted
DEAD_EXIT_DELAY_S = 2.0  # after the engine dies, /health answers 503 this long before the process exits
GENERATION_ROUTES = {
    "/v1/completions": (CompletionRequest, CompletionRenderer),
    "/v1/chat/completions": (ChatCompletionRequest, ChatRenderer),
}
# The APIs served by translating each request into a chat completion
TRANSLATED_ROUTES = {
    "/v1/messages": (MessagesRequest, MessagesRenderer),
    "/v1/responses": (ResponsesRequest, ResponsesRenderer),
}
try:
    VERSION = importlib.metadata.version("pico-vllm")
except importlib.metadata.PackageNotFoundError:
    VERSION = "0+source"


@dataclass(slots=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: list[str] | None = None  # names the API answers to; the first is reported
    api_key: str | None = None
    shutdown_timeout: float = 10.0  # on SIGTERM, in-flight requests may take this long, then are aborted
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser: thoughts apart from the answer (qwen3)


class ServerState:
    """What the routes share: the engine (None while it loads), model names, sampling defaults, metrics."""

    def __init__(self, options: ServerOptions, model: str, defaults: dict):
        self.options = options
        self.names = options.served_model_name or [model]
        self.defaults = defaults
        self.metrics = Metrics(self.names[0])
        self.engine: AsyncLLM | None = None
        self.exit_code = 0
        self.stopping = threading.Event()  # set at shutdown: an engine still starting stops at once
        self.stop: Callable[[], None] = lambda: None  # run_server points this at uvicorn's exit flag

    def ready_engine(self) -> AsyncLLM:
        if self.engine is None:
            raise APIError(503, "the engine is still loading: retry when /health answers 200", code="engine_loading")
        if not self.engine.is_alive:
            raise APIError(503, f"the engine is dead: {self.engine.dead_reason}", code="engine_dead")
        return self.engine

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise APIError(
                404,
                f"this server serves {self.names}; model {name[:100]!r} does not exist",
                param="model",
                code="model_not_found",
            )

    def model_card(self, name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "pico-vllm",
            "root": self.names[0],
            "max_model_len": self.engine.max_model_len if self.engine is not None else None,
        }

    async def accept(self, request: Request, model: type[BaseModel]) -> tuple:
        """The validated request (413 past MAX_BODY_BYTES, before all is buffered) and the ready engine."""
        declared = request.headers.get("content-length", "")
        too_large = APIError(413, f"request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise too_large
        req = parse_request(model, body)
        self.check_model(req.model)
        return req, self.ready_engine()

    def check_key(self, request: Request) -> None:
        """Bearer API key (or Anthropic's x-api-key), compared in constant time (a timing side channel would leak
        it byte by byte)."""
        key = self.options.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = request.headers.get("x-api-key") or (token.strip() if scheme.lower() == "bearer" else "")
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                code="invalid_api_key",
            )


def build_app(state: ServerState, load_engine: Callable[[], AsyncLLM]) -> FastAPI:
    """The app; `load_engine` runs in a thread at startup so that /health can answer 503 meanwhile."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(_load_and_watch(state, load_engine))
        yield
        state.stopping.set()
        loader.cancel()
        if state.engine is not None:
            # Let the requests uvicorn has just cancelled send their Aborts before shutdown() closes the socket.
            deadline = time.monotonic() + 1.0
            while state.engine.processor.num_pending and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            state.engine.shutdown()

    app = FastAPI(
        title="Pico-vLLM", version=VERSION, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.add_exception_handler(APIError, _error)
    app.add_exception_handler(StarletteHTTPException, _error)
    app.add_exception_handler(ClientGone, lambda request, exc: Response(status_code=499))

    @app.get("/health")  # what a load balancer or supervisor polls: no API key, as /version
    async def health() -> Response:
        state.ready_engine()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    app.include_router(_routes(state), dependencies=[Depends(state.check_key)])
    return app


async def _error(request: Request, exc: Exception) -> JSONResponse:
    headers = None
    if isinstance(exc, StarletteHTTPException):  # unknown routes and wrong methods, in the same error body
        headers = exc.headers  # a 405's Allow
        exc = APIError(
            exc.status_code, str(exc.detail), code={404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        )
    body = anthropic_error(exc) if request.url.path.startswith("/v1/messages") else exc.body()
    return JSONResponse(body, status_code=exc.status, headers=headers)


async def _load_and_watch(state: ServerState, load_engine: Callable[[], AsyncLLM]) -> None:
    """Load the engine; then, should it die, exit non-zero so that a supervisor restarts the server."""
    try:
        state.engine = await asyncio.to_thread(load_engine)
        log.info("engine ready; serving %s", state.names)
        while state.engine.is_alive:  # AsyncLLM offers no awaitable for death; a cheap poll suffices
            await asyncio.sleep(0.5)
        log.error("the engine died (%s); exiting in %.0f s", state.engine.dead_reason, DEAD_EXIT_DELAY_S)
        await asyncio.sleep(DEAD_EXIT_DELAY_S)
    except Exception as exc:
        log.error("the engine failed to start: %s", exc)
    state.exit_code = 1
    state.stop()


def _routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [state.model_card(name) for name in state.names]}

    @router.get("/v1/models/{model_id:path}")  # path: ids such as "Qwen/Qwen2.5-1.5B" hold a slash
    async def model(model_id: str) -> dict:
        state.check_model(model_id)
        return state.model_card(model_id)

    @router.get("/metrics")
    async def metrics() -> Response:
        if state.engine is not None and state.engine.is_alive:  # a dead engine: the last gauges stand
            state.metrics.observe_engine(await state.engine.get_stats())
        return Response(state.metrics.render(), media_type=Metrics.content_type)

    @router.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req, engine = await state.accept(request, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send exactly one of prompt and messages", "prompt")
        ids = (
            chat_prompt(req.messages, engine.tokenizer, req.add_generation_prompt, req.continue_final_message)
            if req.messages is not None
            else engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        )
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req, engine = await state.accept(request, DetokenizeRequest)
        vocab = engine.model_config.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    @router.post("/v1/completions")
    @router.post("/v1/chat/completions")
    async def generate(request: Request) -> Response:
        kind, render = GENERATION_ROUTES[request.scope["route"].path]
        req, engine = await state.accept(request, kind)
        return await run(request, engine, req, f"{kind.id_prefix}-{uuid.uuid4().hex}", render)

    @router.post("/v1/messages")
    @router.post("/v1/responses")
    async def translated(request: Request) -> Response:
        """Anthropic's Messages and OpenAI's Responses: one chat completion, rendered in the API's own shape."""
        kind, render = TRANSLATED_ROUTES[request.scope["route"].path]
        front, engine = await state.accept(request, kind)
        try:
            rid = f"{kind.id_prefix}_{uuid.uuid4().hex}"
            return await run(request, engine, front.chat_request(), rid, partial(render, front=front))
        except APIError as exc:
            raise renamed(exc, kind.field_names) from None

    @router.get("/v1/responses/{response_id}")
    @router.delete("/v1/responses/{response_id}")
    async def stored_response(response_id: str) -> Response:
        raise APIError(404, f"response {response_id[:100]!r} not found: responses are not stored", code="not_found")

    async def run(request: Request, engine: AsyncLLM, req: SamplingRequest, rid: str, render: Callable) -> Response:
        """Each prompt of the request is one engine request (its n samples fan out inside AsyncLLM)."""
        req.bind(engine.tokenizer, state.options.reasoning_parser)
        params = req.sampling_params(state.defaults)
        if params.structured_outputs is not None:  # a bad schema, regex or grammar is a 400 before the engine
            try:  # in a thread: the first one imports xgrammar (seconds), and the loop keeps serving
                await asyncio.to_thread(build_grammar, params.structured_outputs)
            except InvalidParam as exc:
                raise req.invalid(exc) from None
        prompts = req.truncated(req.prompts(engine.tokenizer), engine.tokenizer, engine.max_model_len)
        try:
            jobs = [
                Job(f"{rid}-{i}", *engine.client.prepare(prompt, params), params) for i, prompt in enumerate(prompts)
            ]
        except InvalidParam as exc:
            raise from_invalid_param(exc, req.prompt_field, req.max_tokens_field) from None
        renderer = render(rid, state.names[0], jobs, engine.tokenizer, req)
        return await respond(request, state.ready_engine(), state.metrics, renderer, req.stream)

    return router


class _Server(uvicorn.Server):
    """uvicorn's server, but what still runs near the end of the graceful stop is aborted, not cancelled: each
    request ends as finish_reason "abort" (a stream with its last chunk and [DONE]) and nothing logs an error."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets: list | None = None) -> None:
        delay = max(0.0, self.state.options.shutdown_timeout - ABORT_MARGIN_S)
        engine = self.state.engine
        abort = asyncio.get_running_loop().call_later(delay, engine.abort_all if engine else lambda: None)
        try:
            await super().shutdown(sockets)
        finally:
            abort.cancel()


def run_server(config: EngineConfig, options: ServerOptions) -> int:
    """Serve until SIGINT (130), SIGTERM (the process ends by the signal: 143), or the engine fails or dies (1)."""
    config = resolve_config(config)
    state = ServerState(options, config.model, generation_defaults(config.model_path))
    app = build_app(state, lambda: AsyncLLM(client=EngineClient(config, cancel=state.stopping)))
    # uvicorn's own deadline only backs ours up: past it, it cancels requests mid-body and logs their tracebacks.
    server = _Server(
        uvicorn.Config(
            app,
            host=options.host,
            port=options.port,
            loop="uvloop",
            timeout_graceful_shutdown=options.shutdown_timeout + 2 * ABORT_MARGIN_S,
        ),
        state,
    )
    state.stop = lambda: setattr(server, "should_exit", True)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it has already shut down on
        return 130
    return state.exit_code
