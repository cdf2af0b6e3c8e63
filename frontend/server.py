"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLM, run by uvicorn on uvloop.

Each prompt of a request is one engine request (its n samples fan out inside AsyncLLM); their cumulative
outputs are merged and rendered as JSON or server-sent events. A request ends when its client goes
away: every path that waits on the engine is then cancelled, which aborts its engine requests and frees
their KV blocks.
"""
from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, fields

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from frontend.api_models import (
    APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, Job, TokenizeRequest, bad_request,
    chat_logprobs, chat_prompt, check_stream_options, completion_prompts, generation_defaults, parse_request,
    prepare, sampling_params)
from frontend.api_render import ChatRenderer, CompletionRenderer, Renderer, usage
from frontend.async_llm import AsyncLLM, EngineRequestError
from frontend.engine_client import EngineDeadError
from frontend.launcher import resolve_config
from frontend.metrics import Metrics
from frontend.outputs import RequestOutput
from protocol.config import EngineConfig
from protocol.sampling import SamplingParams

log = logging.getLogger("pico_vllm.server")
MAX_BODY_BYTES = 4 << 20  # a 128k-token prompt is well under 1 MB of text; far larger bodies are abuse
DEAD_EXIT_DELAY_S = 2.0  # after the engine dies, /health answers 503 this long before the process exits
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default; chat defaults to the context


@dataclass(slots=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: list[str] | None = None  # names the API answers to; the first is reported
    api_key: str | None = None
    shutdown_timeout: float = 10.0  # on SIGTERM, in-flight requests may take this long, then are aborted


class ServerState:
    """What the routes share: the engine (None while it loads), model names, sampling defaults, metrics."""

    def __init__(self, options: ServerOptions, model: str, defaults: dict):
        self.options = options
        self.names = options.served_model_name or [model]
        self.defaults = defaults
        self.metrics = Metrics(self.names[0])
        self.engine: AsyncLLM | None = None
        self.exit_code = 0
        self.stop: Callable[[], None] = lambda: None  # run_server points this at uvicorn's exit flag

    def ready_engine(self) -> AsyncLLM:
        if self.engine is None:
            raise APIError(503, "the engine is still loading: retry when /health answers 200", code="engine_loading")
        if not self.engine.is_alive:
            raise APIError(503, f"the engine is dead: {self.engine.dead_reason}", code="engine_dead")
        return self.engine

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise APIError(404, f"this server serves {self.names}; model {name[:100]!r} does not exist",
                           param="model", code="model_not_found")

    async def accept(self, request: Request, model: type[BaseModel]) -> tuple:
        """The validated request, for a model this server serves, and the engine ready to take it."""
        req = parse_request(model, await read_body(request))
        self.check_model(req.model)
        return req, self.ready_engine()

    def job(self, engine: AsyncLLM, request_id: str, prompt: str | list[int], params: SamplingParams,
            param: str) -> Job:
        return prepare(request_id, engine.tokenizer, prompt, params, engine.max_model_len,
                       engine.model_config.vocab_size, param)

    def check_key(self, request: Request) -> None:
        """Bearer API key, compared in constant time (a timing side channel would leak it byte by byte)."""
        key = self.options.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")


# ---- reading requests and driving the engine ---------------------------------------------------------------

async def read_body(request: Request) -> bytes:
    """The body, refused (413) past MAX_BODY_BYTES before it is all buffered."""
    declared = request.headers.get("content-length", "")
    too_large = APIError(413, f"request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def engine_error(exc: Exception) -> APIError:
    """An exception from the engine as the status a client can act on (503: retry elsewhere/later)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is dead: {exc}", code="engine_dead")
    if isinstance(exc, EngineRequestError):  # the scheduler refused this one request
        if "overloaded" in str(exc):
            return APIError(503, str(exc), code="engine_overloaded")
        return bad_request(f"the engine refused the request: {exc}")
    log.error("engine fault", exc_info=exc)
    return APIError(500, f"engine fault: {type(exc).__name__}: {exc}", code="engine_error")


async def generate(engine: AsyncLLM, job: Job, metrics: Metrics) -> AsyncIterator[RequestOutput]:
    """One engine request's outputs, timed for /metrics; closing this early aborts the request."""
    timer = metrics.request(len(job.token_ids))
    out = None
    try:
        async with aclosing(engine.generate(job.token_ids, job.params, job.request_id)) as outputs:
            async for out in outputs:
                timer.on_tokens(sum(len(o.token_ids) for o in out.outputs))
                yield out
    finally:
        timer.finish([o.finish_reason or "abort" for o in out.outputs] if out else ["abort"] * job.params.n)


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) as each arrives; closing the merge closes (aborts) every stream."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for out in only:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(stream):
                async for out in stream:
                    queue.put_nowait((i, out, None))
            queue.put_nowait((i, None, None))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((i, None, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out, exc = await queue.get()
            if exc is not None:
                raise exc
            if out is None:
                remaining -= 1
            else:
                yield i, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ClientGone(Exception):
    """The client hung up before its response was ready; its engine requests are already aborted."""


async def until_disconnected(request: Request, work: Awaitable):
    """Await `work` unless the client hangs up first; then cancel it, which aborts its engine requests."""
    task = asyncio.ensure_future(work)
    watch = asyncio.create_task(_client_gone(request))
    try:
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # we are cancelled ourselves (shutdown): so is the work
        task.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done():  # the client left first; cancel() lets the work clean up (abort) when it next runs
        task.cancel()
        raise ClientGone()
    return task.result()


async def _client_gone(request: Request) -> None:
    """Returns when the ASGI server reports the disconnect (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(merged: AsyncIterator[tuple[int, RequestOutput]], count: int) -> list[RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async with aclosing(merged):
        async for i, out in merged:
            finals[i] = out
    return [finals[i] for i in range(count)]


class EventStream(StreamingResponse):
    """Server-sent events whose generator is closed however the response ends (hang-up, shutdown)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _event(data: BaseModel | dict) -> str:
    return f"data: {data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)}\n\n"


async def _events(first: tuple[int, RequestOutput], merged: AsyncIterator[tuple[int, RequestOutput]],
                  renderer: Renderer, include_usage: bool) -> AsyncIterator[str]:
    finals: dict[int, RequestOutput] = {}
    async with aclosing(merged):
        try:
            for chunk in renderer.opening():
                yield _event(chunk)
            i, out = first
            while True:
                finals[i] = out
                for chunk in renderer.chunks(i, out):
                    yield _event(chunk)
                try:
                    i, out = await anext(merged)
                except StopAsyncIteration:
                    break
            if include_usage:
                yield _event(renderer.usage_chunk(usage(renderer.jobs, [finals[k] for k in sorted(finals)])))
        except Exception as exc:  # the 200 header is out: the error travels in the stream, as OpenAI's does
            yield _event(engine_error(exc).body())
    yield "data: [DONE]\n\n"


async def respond(request: Request, state: ServerState, renderer: Renderer, stream: bool,
                  include_usage: bool) -> Response:
    """Run the renderer's jobs on the engine; answer with one JSON body or an event stream."""
    engine = state.ready_engine()
    merged = merge([generate(engine, job, state.metrics) for job in renderer.jobs])
    try:
        if not stream:
            finals = await until_disconnected(request, _collect(merged, len(renderer.jobs)))
            return Response(renderer.response(finals).model_dump_json(), media_type="application/json")
        # Wait for the first output before sending 200, so that a refusal (overload, dead engine) is a 503.
        first = await until_disconnected(request, anext(merged))
    except ClientGone:
        raise
    except Exception as exc:
        raise engine_error(exc) from None
    return EventStream(_events(first, merged, renderer, include_usage))


# ---- the app -------------------------------------------------------------------------------------------

def _version() -> str:
    try:
        return importlib.metadata.version("pico-vllm")
    except importlib.metadata.PackageNotFoundError:
        return "0+source"


def build_app(state: ServerState, load_engine: Callable[[], AsyncLLM]) -> FastAPI:
    """The app; `load_engine` runs in a thread at startup so that /health can answer 503 meanwhile."""
    app = FastAPI(title="Pico-vLLM", version=_version(), lifespan=_lifespan(state, load_engine),
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientGone, lambda request, exc: Response(status_code=499))
    app.include_router(_public_routes(state))
    app.include_router(_info_routes(state))
    app.include_router(_generation_routes(state))
    return app


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes and wrong methods, in the same error body as everything else."""
    return await _api_error(request, APIError(exc.status_code, str(exc.detail), code="not_found"
                                              if exc.status_code == 404 else None))


def _lifespan(state: ServerState, load_engine: Callable[[], AsyncLLM]):
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = asyncio.create_task(_load_and_watch(state, load_engine))
        yield
        loader.cancel()
        if state.engine is not None:
            await _settle(state.engine)
            state.engine.shutdown()
    return lifespan


async def _settle(engine: AsyncLLM, timeout: float = 1.0) -> None:
    """Let the requests that uvicorn has just cancelled (shutdown timeout) run their clean-up first: it
    sends their Aborts on the engine's socket, which shutdown() is about to close under them."""
    deadline = time.monotonic() + timeout
    while engine.processor.num_pending and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def _load_and_watch(state: ServerState, load_engine: Callable[[], AsyncLLM]) -> None:
    """Load the engine; then, should it die, exit non-zero so that a supervisor restarts the server."""
    try:
        state.engine = await asyncio.to_thread(load_engine)
    except Exception as exc:
        log.error("the engine failed to start: %s", exc)
        state.exit_code = 1
        state.stop()
        return
    log.info("engine ready; serving %s", state.names)
    while state.engine.is_alive:  # AsyncLLM offers no awaitable for death; a cheap poll suffices
        await asyncio.sleep(0.5)
    log.error("the engine died (%s); exiting in %.0f s", state.engine.dead_reason, DEAD_EXIT_DELAY_S)
    await asyncio.sleep(DEAD_EXIT_DELAY_S)
    state.exit_code = 1
    state.stop()


def _public_routes(state: ServerState) -> APIRouter:
    """The two routes a load balancer or supervisor polls: no API key."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        state.ready_engine()
        return Response(status_code=200)

    @router.get("/version")
    async def version() -> dict:
        return {"version": _version()}

    return router


def _info_routes(state: ServerState) -> APIRouter:
    router = APIRouter(dependencies=[Depends(state.check_key)])

    @router.get("/v1/models")
    async def models() -> dict:
        max_len = state.engine.max_model_len if state.engine is not None else None
        cards = [{"id": name, "object": "model", "created": 0, "owned_by": "pico-vllm", "root": state.names[0],
                  "max_model_len": max_len} for name in state.names]
        return {"object": "list", "data": cards}

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
        ids = (chat_prompt(req.messages, engine.tokenizer, req.add_generation_prompt) if req.messages is not None
               else engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req, engine = await state.accept(request, DetokenizeRequest)
        vocab = engine.model_config.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    return router


def _generation_routes(state: ServerState) -> APIRouter:
    router = APIRouter(dependencies=[Depends(state.check_key)])

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req, engine = await state.accept(request, CompletionRequest)
        check_stream_options(req)
        if req.echo and req.logprobs is not None:
            raise bad_request("echo with logprobs is not supported: prompt logprobs are not computed", "echo")
        max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
        params = sampling_params(req, state.defaults, max_tokens, req.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        jobs = [state.job(engine, f"{rid}-{i}", p, params, "prompt") for i, p in enumerate(completion_prompts(req))]
        renderer = CompletionRenderer(rid, state.names[0], jobs, engine.tokenizer, req.echo)
        return await respond(request, state, renderer, req.stream, req.include_usage)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req, engine = await state.accept(request, ChatCompletionRequest)
        check_stream_options(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling_params(req, state.defaults, max_tokens, chat_logprobs(req))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        jobs = [state.job(engine, rid, chat_prompt(req.messages, engine.tokenizer), params, "messages")]
        renderer = ChatRenderer(rid, state.names[0], jobs, engine.tokenizer)
        return await respond(request, state, renderer, req.stream, req.include_usage)

    return router


def run_server(config: EngineConfig, options: ServerOptions) -> int:
    """Serve until SIGINT (130) or SIGTERM (uvicorn re-raises it after the graceful shutdown: the process
    ends by the signal, status 143), or until the engine fails to start or dies (1)."""
    config = resolve_config(config)  # here too, to read the checkpoint's generation defaults up front
    state = ServerState(options, config.model, generation_defaults(config.model_path))
    engine_kwargs = {f.name: getattr(config, f.name) for f in fields(config)}
    app = build_app(state, lambda: AsyncLLM(**engine_kwargs))
    server = uvicorn.Server(uvicorn.Config(app, host=options.host, port=options.port, loop="uvloop",
                                           timeout_graceful_shutdown=options.shutdown_timeout))
    state.stop = lambda: setattr(server, "should_exit", True)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it has already shut down on
        return 130
    return state.exit_code
