"""A request's jobs answered as JSON or server-sent events; a client that hangs up aborts its engine requests."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from frontend.api_errors import APIError, bad_request
from frontend.api_params import Job
from frontend.api_render import Renderer
from frontend.async_llm import AsyncLLM, EngineRequestError
from frontend.engine_client import EngineDeadError
from frontend.metrics import Metrics, RequestTimer
from frontend.output_processor import RequestOutput
from protocol.messages import OVERLOADED

T = TypeVar("T")
log = logging.getLogger("pico_vllm.server")


def engine_error(exc: Exception) -> APIError:
    """An exception from the engine as the status a client can act on (503: retry elsewhere/later)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is dead: {exc}", code="engine_dead")
    if isinstance(exc, EngineRequestError):  # the scheduler refused this one request
        if str(exc).startswith(OVERLOADED):
            return APIError(503, str(exc), code="engine_overloaded")
        return bad_request(f"the engine refused the request: {exc}")
    log.error("engine fault", exc_info=exc)
    return APIError(500, f"engine fault: {type(exc).__name__}: {exc}", code="engine_error")


async def generate(engine: AsyncLLM, jobs: list[Job], metrics: Metrics) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(job index, output) as each arrives, timed for /metrics; closing this early aborts every job."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, job: Job) -> None:
        timer, out = RequestTimer(metrics, len(job.token_ids), job.params.n), None
        try:
            async with aclosing(engine.generate(job.token_ids, job.params, job.request_id)) as outputs:
                async for out in outputs:
                    timer.on_tokens([len(o.token_ids) for o in out.outputs])
                    queue.put_nowait((i, out, None))
            queue.put_nowait((i, None, None))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((i, None, exc))
        finally:
            timer.finish(
                [o.finish_reason or "abort" for o in out.outputs] if out else ["abort"] * job.params.n,
                [o.engine_stats for o in out.outputs] if out else None,
            )

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
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


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work` unless the client hangs up first; then cancel it, which aborts its engine requests."""

    async def client_gone() -> None:  # the body has been read: the next message is the disconnect
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.create_task(client_gone())
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


async def _collect(merged: AsyncIterator[tuple[int, RequestOutput]]) -> dict[int, RequestOutput]:
    async with aclosing(merged):
        return {i: out async for i, out in merged}


class EventStream(StreamingResponse):
    """Server-sent events whose generator is closed however the response ends (hang-up, shutdown)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _events(
    first: tuple[int, RequestOutput], merged: AsyncIterator[tuple[int, RequestOutput]], renderer: Renderer
) -> AsyncIterator[str]:
    finals: dict[int, RequestOutput] = {}
    async with aclosing(merged):
        try:
            for chunk in renderer.opening():
                yield renderer.event(chunk)
            news: tuple[int, RequestOutput] | None = first
            while news is not None:
                i, out = news
                finals[i] = out
                for chunk in renderer.chunks(i, out):
                    yield renderer.event(chunk)
                news = await anext(merged, None)
            for chunk in renderer.closing([finals[i] for i in sorted(finals)]):
                yield renderer.event(chunk)
        except Exception as exc:  # the 200 header is out: the error travels in the stream
            yield renderer.event(renderer.error(engine_error(exc)))
    if renderer.done is not None:
        yield renderer.done


async def respond(request: Request, engine: AsyncLLM, metrics: Metrics, renderer: Renderer, stream: bool) -> Response:
    """Run the renderer's jobs on the engine; answer with one JSON body or an event stream."""
    merged = generate(engine, renderer.jobs, metrics)
    try:
        if not stream:
            finals = await until_disconnected(request, _collect(merged))
            return Response(
                json.dumps(renderer.response([finals[i] for i in range(len(renderer.jobs))])),
                media_type="application/json",
            )
        # Wait for the first output before sending 200, so that a refusal (overload, dead engine) is a 503.
        first = await until_disconnected(request, anext(merged))
    except ClientGone:
        raise
    except Exception as exc:
        raise engine_error(exc) from None
    return EventStream(_events(first, merged, renderer))
