"""AsyncLLM: the asyncio API, for the HTTP server and for embedding behind other frontends."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Iterable

import zmq.asyncio

from frontend.engine_client import EngineClient, EngineDeadError, Prompt
from frontend.model_resolution import resolve_config
from frontend.output_processor import OutputProcessor, RequestOutput
from protocol.codec import encode
from protocol.config import EngineConfig
from protocol.messages import READY_TIMEOUT_S, Abort, EngineDead, GetStats, TokenBatch
from protocol.sampling import SamplingParams

PROBE_AFTER_S = 1.0  # silence, with requests pending, before a remote engine is asked for its stats
REMOTE_SILENCE_S = 10.0  # silence after which a remote engine is taken for dead


class EngineRequestError(RuntimeError):
    """The engine refused or failed one request (e.g. overloaded); the engine itself is fine."""


class AsyncLLM:
    """`AsyncLLM(model, **engine options)` starts an engine; `AsyncLLM.connect(address)` attaches to one."""

    def __init__(self, model: str | None = None, *, client: EngineClient | None = None, **kwargs) -> None:
        self.client = client = client or EngineClient(resolve_config(EngineConfig(model=model, **kwargs)))
        self.tokenizer = client.tokenizer
        self.model_config = client.model_config
        self.max_model_len = client.max_model_len
        self.processor = OutputProcessor(client.tokenizer)
        self.dead_reason: str | None = None
        self._events: dict[str, asyncio.Event] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._asock: zmq.asyncio.Socket | None = None
        self._stats_waiters: list[asyncio.Future] = []
        if client.procs is not None:
            client.procs.on_death(self._on_death_from_thread)

    @classmethod
    def connect(cls, address: str, timeout: float = READY_TIMEOUT_S) -> AsyncLLM:
        """Attach to a headless engine (launch.py --headless --engine-address ADDR); EngineDeadError after timeout."""
        return cls(client=EngineClient(address=address, ready_timeout=timeout))

    def _ensure_started(self) -> None:
        if self.dead_reason:  # every call into a dead engine raises, on any loop
            raise EngineDeadError(self.dead_reason)
        loop = asyncio.get_running_loop()
        if self._task is not None and self._loop is not loop:
            if self._loop.is_running():
                raise RuntimeError(
                    "this AsyncLLM is in use on another event loop (another thread): call it "
                    "from that loop, or create one AsyncLLM per event loop"
                )
            # The loop it ran on has ended (asyncio.run returned): its receive task and socket are dead.
            if not self._loop.is_closed():
                self._task.cancel()
            self._task = None
        if self._task is None:
            self._loop = loop
            self._stats_waiters = []
            # Every send and receive goes through this one asyncio socket: a plain send on the same zmq
            # socket can consume the wake-up that the asyncio receive waits for, and replies sit unread.
            self._asock = zmq.asyncio.Socket.from_socket(self.client.sock)
            self._task = self._loop.create_task(self._recv_loop())

    def _send(self, msg) -> None:
        self._asock.send(encode(msg))  # never client.send: see _ensure_started

    async def _recv_loop(self) -> None:
        try:
            while True:
                msg = self.client.decode(await self._next_frame())
                if isinstance(msg, TokenBatch):
                    self._apply(msg)
                elif isinstance(msg, EngineDead):
                    self._fail(msg.reason)
                    return
        except EngineDeadError as e:
            self._fail(str(e))
        except Exception as e:  # a dead receive loop would leave every request waiting forever
            self._fail(f"the frontend's receive loop failed: {type(e).__name__}: {e}")

    async def _next_frame(self) -> bytes:
        """Our own engine's death is reported by the launcher's watcher; a silent remote one is probed with GetStats
        (answered even mid-step) while requests wait, and declared dead after REMOTE_SILENCE_S."""
        if self.client.procs is not None:
            return await self._asock.recv()
        silent_since = time.monotonic()
        while True:
            try:
                return await asyncio.wait_for(self._asock.recv(), PROBE_AFTER_S)
            except asyncio.TimeoutError:
                if not self.processor.num_pending:
                    silent_since = time.monotonic()
                elif time.monotonic() - silent_since > REMOTE_SILENCE_S:
                    raise EngineDeadError(
                        f"the engine at {self.client.address} stopped answering for {REMOTE_SILENCE_S:.0f} s"
                    ) from None
                else:
                    self._send(GetStats())

    def _apply(self, batch: TokenBatch) -> None:
        if not batch.request_ids:  # the answer to a GetStats
            waiters, self._stats_waiters = self._stats_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(batch.stats)
        with self.client.tracer.span("frontend.detokenize", batch.step):
            changed, to_abort = self.processor.process(batch)
        if to_abort:
            self._send(Abort(to_abort))
        self._wake(state.output.request_id for state in changed)

    def _on_death_from_thread(self, reason: str) -> None:
        self.dead_reason = reason  # seen by the next call on any loop, also when the last one has closed
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits on it
                self._loop.call_soon_threadsafe(self._fail, reason)  # wakes the requests waiting there

    def _fail(self, reason: str) -> None:
        self.dead_reason = reason
        self._wake(state.output.request_id for state in self.processor.fail_all(reason))

    def _wake(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            event = self._events.get(request_id)
            if event is not None:
                event.set()

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until finished; leaving the loop early aborts the request."""
        self._ensure_started()
        request_id = request_id or f"req-{next(self._ids)}"
        tracer = self.client.tracer
        with tracer.span("frontend.tokenize"):
            params = params or SamplingParams()
            text, ids = self.client.prepare(prompt, params)
        state, msgs = self.processor.register(request_id, text, ids, params)
        event = self._events[request_id] = asyncio.Event()
        try:
            with tracer.span("frontend.send"):
                for msg in msgs:
                    self._send(msg)
            while True:
                await event.wait()
                event.clear()
                if state.output.error is not None:
                    raise (EngineRequestError if self.dead_reason is None else EngineDeadError)(state.output.error)
                with tracer.span("frontend.stream"):
                    out = dataclasses.replace(state.output, outputs=[o.snapshot() for o in state.output.outputs])
                yield out
                if out.finished:  # not state.finished: it may have finished while the caller held `out`
                    return
        finally:
            self._events.pop(request_id, None)
            if not state.output.finished:
                self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> None:
        engine_ids = self.processor.abort(request_id)
        if engine_ids and self.dead_reason is None:
            self._send(Abort(engine_ids))
        self._wake([request_id])  # its generate() yields it finished as "abort"

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)

    def abort_all(self) -> None:
        """End every request in flight as finish_reason "abort" (a stream gets its last chunk): a stop's deadline."""
        for request_id in list(self._events):
            self._abort_now(request_id)

    async def get_stats(self, timeout: float = 5.0) -> dict:
        """Fresh engine counters: a round trip to the scheduler."""
        self._ensure_started()
        waiter = self._loop.create_future()
        self._stats_waiters.append(waiter)
        self._send(GetStats())
        return dict(await asyncio.wait_for(waiter, timeout))

    def shutdown(self) -> None:
        """Stop the engine we started (detach from a remote one); requests still waiting fail with EngineDeadError."""
        if self.client is None:
            return
        if self.dead_reason is None:
            self._fail("this AsyncLLM was shut down: create a new one to generate again")
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self.client.close()
        self.client = None
