"""The scheduler process: frontends on a ROUTER, one PUSH of plans per worker rank, results on a PULL.

No CUDA here (torch loads with xgrammar, at the first grammar). A malformed frame from a frontend is answered, one
from a worker dropped; a worker error, a stalled step or a dead parent ends the process (EngineDead to every client,
exit code 1). Two plans in flight: plan N+1 is sent before result N is awaited."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import time
from collections import deque
from dataclasses import asdict

import zmq

from protocol.addresses import Addresses, remove_ipc_dir
from protocol.codec import MAX_FRAME_BYTES, ProtocolError, decode, encode
from protocol.config import EngineConfig
from protocol.messages import (
    READY_TIMEOUT_S,
    Abort,
    AddRequest,
    EngineDead,
    Error,
    GetStats,
    GrammarMask,
    Ready,
    Shutdown,
    StepPlan,
    StepResult,
    TokenBatch,
    WorkerError,
    i32,
)
from protocol.shared_masks import masks_path
from protocol.tracing import Tracer
from scheduler.scheduler import Scheduler

log = logging.getLogger("pico_vllm.scheduler")
POLL_MS = 100  # the idle poll, and so how often the parent is checked
COMPILE_POLL_MS = 2  # the idle poll while a grammar compiles: its request starts soon after
LINGER_MS = 1000  # time for the last EngineDead / Shutdown to leave at exit
MAX_IN_FLIGHT = 2  # the worker keeps two staging buffers: step N+1 may launch before N is collected
SHUTDOWN_REFUSED = (
    "Shutdown refused: only the frontend that started this engine may stop it; stop a headless engine "
    "with SIGTERM, or start it with --allow-remote-shutdown"
)


class _Exit(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Exit(0, "the scheduler got SIGTERM")


def run_scheduler(
    config_dict: dict, addresses_dict: dict, parent_pid: int | None = None, owner: bytes | None = None
) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, _on_sigterm)
    sys.exit(serve(EngineConfig.from_dict(config_dict), Addresses(**addresses_dict), parent_pid, owner))


def serve(config: EngineConfig, addresses: Addresses, parent_pid: int | None = None, owner: bytes | None = None) -> int:
    """Serve until Shutdown from `owner` (the identity of the frontend that started us) or SIGTERM, or until
    `parent_pid` dies; return the exit code. The ipc dir and socket file go: nobody else may be left."""
    server = SchedulerServer(config, addresses, parent_pid or os.getppid(), owner)
    try:
        return server.run()
    finally:
        server.tracer.flush()
        server.ctx.destroy(linger=LINGER_MS)
        remove_ipc_dir(addresses)
        if addresses.engine.startswith("ipc://"):  # libzmq leaves a socket file where it bound
            with contextlib.suppress(OSError):
                os.unlink(addresses.engine[len("ipc://") :])


class SchedulerServer:
    def __init__(self, config: EngineConfig, addresses: Addresses, parent_pid: int, owner: bytes | None) -> None:
        self.config, self.addresses, self.parent, self.owner = config, addresses, parent_pid, owner
        self.ctx = zmq.Context()
        self.engine = self._bind(zmq.ROUTER, addresses.engine)
        self.plans = [self._bind(zmq.PUSH, addr) for addr in addresses.plans]
        self.results = self._bind(zmq.PULL, addresses.results)
        self.poller = zmq.Poller()
        for sock in (self.engine, self.results):
            self.poller.register(sock, zmq.POLLIN)
        self.clients: set[bytes] = set()  # every frontend identity seen; each got Ready once
        self.tracer = Tracer("scheduler", config.trace_dir)
        self.scheduler: Scheduler | None = None
        self.early: list[tuple[bytes, object]] = []  # frontend messages from before the workers were ready
        self.in_flight: deque[int] = deque()  # steps sent and not yet answered, oldest first

    def _bind(self, kind: int, address: str) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # the codec's cap, enforced before buffering
        if kind == zmq.ROUTER:  # set before bind, so that every peer's pipe gets it
            sock.setsockopt(zmq.SNDHWM, 0)  # past its high-water mark a ROUTER drops frames: a slow client's tokens
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a client that has gone fails: _send aborts its work
        if kind == zmq.PUSH:  # a dead worker must not block the loop forever
            sock.setsockopt(zmq.SNDTIMEO, int(self.config.step_timeout * 1000))
        sock.bind(address)
        return sock

    def run(self) -> int:
        try:
            num_blocks, startup = self._wait_workers()
            self.scheduler = sched = Scheduler(self.config, num_blocks, masks_path(self.addresses.ipc_dir))
            self.info = {
                "num_kv_blocks": sched.block_manager.num_blocks,
                "max_model_len": sched.max_model_len,
                "vocab_size": sched.vocab_size,
                "eos_token_ids": sorted(sched.eos_token_ids),
                "block_size": self.config.block_size,
                "model": self.config.model,
                "model_path": self.config.model_path,
                "model_config": asdict(self.config.model_config),
                "startup": startup,
            }
            gc.collect()
            gc.freeze()  # start-up objects leave the collector's view: a full collection stays short
            log.info("scheduler ready: %s", {k: self.info[k] for k in ("num_kv_blocks", "max_model_len")})
            for identity, msg in self.early:
                self._handle(identity, msg)
            self.early.clear()
            while True:
                busy = self._step()
                idle_ms = COMPILE_POLL_MS if self.scheduler.structured.compiling else POLL_MS
                msg = self._poll(0 if busy else idle_ms, read_results=not self.in_flight)  # else _wait_result's
                if msg is not None:
                    log.warning("dropped a %s from a worker: no step is in flight", type(msg).__name__)
        except _Exit as e:
            return self._exit(e)

    def _exit(self, e: _Exit) -> int:
        """EngineDead to every client, even unserved ones; Shutdown to workers that take it within a second."""
        (log.error if e.code else log.info)("scheduler stopping: %s", e.reason)
        self.clients.update(identity for identity, _ in self.early + self._recv_clients())
        frame = encode(EngineDead(e.reason))
        for identity in self.clients:
            with contextlib.suppress(zmq.ZMQError):  # it has gone
                self.engine.send_multipart([identity, frame])
        frame, deadline = encode(Shutdown()), time.monotonic() + 1.0
        for rank, sock in enumerate(self.plans):
            if sock.poll(max(0.0, deadline - time.monotonic()) * 1000, zmq.POLLOUT):
                sock.send(frame, zmq.NOBLOCK)
            else:
                log.warning("worker %d took no Shutdown: it is gone or stuck", rank)
        return e.code

    def _wait_workers(self) -> tuple[int, dict]:
        """Collect Ready from every rank; return the fewest KV blocks of any, and rank 0's start-up seconds."""
        infos, deadline = {}, time.monotonic() + READY_TIMEOUT_S  # rank -> its Ready.info
        while len(infos) < len(self.plans):
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(self.plans))) - set(infos))
                raise _Exit(1, f"worker ranks {missing} sent no Ready within {READY_TIMEOUT_S:.0f} s")
            msg = self._poll(POLL_MS)
            if isinstance(msg, Ready) and msg.role == "worker" and 0 <= msg.rank < len(self.plans):
                num = msg.info.get("num_kv_blocks")
                if isinstance(num, int) and num >= 2:
                    infos[msg.rank] = msg.info
                else:
                    log.warning("dropped Ready from worker %d: num_kv_blocks=%r is not an int >= 2", msg.rank, num)
        return min(info["num_kv_blocks"] for info in infos.values()), infos[0].get("startup", {})

    def _poll(self, timeout_ms: float, read_results: bool = True):
        """Serve frontends and check the parent for up to timeout_ms; return a worker's message, if one came."""
        events = dict(self.poller.poll(timeout_ms))
        if self.engine in events:
            for identity, msg in self._recv_clients():
                self._handle(identity, msg)
        if os.getppid() != self.parent:
            raise _Exit(1, f"the parent process (pid {self.parent}) died")
        msg = None
        if read_results and self.results in events:
            try:
                msg = decode(self.results.recv())
            except ProtocolError as e:
                log.warning("dropped a malformed frame from a worker: %s", e)
        if isinstance(msg, WorkerError):
            raise _Exit(1, f"worker {msg.rank} failed{' to start' if self.scheduler is None else ''}: {msg.reason}")
        return msg

    def _recv_clients(self) -> list[tuple[bytes, object]]:
        out = []
        while True:
            try:
                frames = self.engine.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                if len(frames) != 2:
                    raise ProtocolError(f"a message of {len(frames) - 1} frames: send one frame per message")
                out.append((frames[0], decode(frames[1])))
            except ProtocolError as e:
                log.warning("dropped a malformed frame from a frontend: %s", e)
                out.append((frames[0], e))

    def _handle(self, identity: bytes, msg) -> None:
        if self.scheduler is None:  # held until the workers are ready
            self.early.append((identity, msg))
            if isinstance(msg, Shutdown) and self._may_shut_down(identity):
                raise _Exit(0, "Shutdown before the workers were ready")
            return
        if identity not in self.clients:  # a new frontend: its first message, whatever it is, is its hello
            self.clients.add(identity)
            self._send(identity, Ready(role="engine", info=self.info))
        sched = self.scheduler
        if isinstance(msg, AddRequest):
            replies = sched.add_request(msg, identity)
        elif isinstance(msg, Abort):
            replies = sched.abort(msg.request_ids, identity)
        elif isinstance(msg, GetStats):
            replies = [(identity, TokenBatch(sched.step, [], i32([]), stats=sched.stats()))]
        elif isinstance(msg, Shutdown) and self._may_shut_down(identity):
            raise _Exit(0, "a frontend asked to shut down")
        elif isinstance(msg, Shutdown):
            replies = [(identity, Error(SHUTDOWN_REFUSED))]
        elif isinstance(msg, ProtocolError):
            replies = sched.refuse(identity, msg.request_id, f"malformed frame: {msg}")
        else:
            name = type(msg).__name__
            log.warning("dropped a %s from a frontend: not a frontend message", name)
            replies = [
                (identity, Error(f"a {name} is not a frontend message: send AddRequest, Abort, GetStats or Shutdown"))
            ]
        for client, reply in replies:
            self._send(client, reply)

    def _may_shut_down(self, identity: bytes) -> bool:
        return identity == self.owner or self.config.allow_remote_shutdown

    def _send(self, identity: bytes, msg) -> None:
        try:
            self.engine.send_multipart([identity, encode(msg)])
        except zmq.ZMQError as e:  # EHOSTUNREACH: the client closed its socket, and nobody reads its tokens
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self.clients.discard(identity)
            if n := self.scheduler.abort_client(identity):
                log.info("aborted %d requests of a client that has gone", n)

    def _step(self) -> bool:
        """Top up the plans in flight, then wait for the oldest one's result; False when idle."""
        sched = self.scheduler
        for client, batch in sched.admit_compiled():
            self._send(client, batch)
        while len(self.in_flight) < MAX_IN_FLIGHT and sched.has_work():
            with self.tracer.span("scheduler.schedule", sched.step + 1):
                if (plan := sched.schedule()) is None:
                    break
                self._send_workers(plan)
            self.in_flight.append(plan.step)
            self._send_mask()
        if not self.in_flight:
            return False
        step = self.in_flight.popleft()
        with self.tracer.span("scheduler.wait_result", step):
            batches = self._wait_result(step)
        self._send_mask()  # before the tokens: the worker waits for it to sample the next step
        with self.tracer.span("scheduler.send_tokens", step):
            for client, batch in batches:
                self._send(client, batch)
        return True

    def _send_workers(self, msg: StepPlan | GrammarMask) -> None:
        frame = encode(msg)
        for rank, sock in enumerate(self.plans):
            try:
                sock.send(frame)
            except zmq.Again:
                raise _Exit(1, f"worker {rank} took no plan for {self.config.step_timeout} s") from None

    def _send_mask(self) -> None:
        """A constrained step's mask, once every step before it has its result (Scheduler.take_mask)."""
        if not self.scheduler.structured.mask_waits:
            return
        with self.tracer.span("scheduler.grammar_mask", self.in_flight[0] if self.in_flight else -1):
            if (mask := self.scheduler.take_mask()) is not None:
                self._send_workers(mask)

    def _wait_result(self, step: int) -> list[tuple[bytes, TokenBatch]]:
        deadline = time.monotonic() + self.config.step_timeout
        while True:
            left_ms = (deadline - time.monotonic()) * 1000
            if left_ms <= 0:
                raise _Exit(1, f"step {step} made no progress for {self.config.step_timeout} s (step_timeout)")
            # Aborts and new requests arrive while the GPU works. Spin while a mask waits on this result: waking
            # from a blocking poll costs ~0.1 ms, and the worker's next draw waits for the mask.
            msg = self._poll(0 if self.scheduler.structured.mask_waits else min(left_ms, POLL_MS))
            if isinstance(msg, StepResult) and msg.step == step:
                try:
                    with self.tracer.span("scheduler.on_result", step):
                        return self.scheduler.on_result(msg)
                except (TypeError, ValueError) as e:  # the step's one answer is unusable: it will not come again
                    raise _Exit(1, f"worker sent a bad StepResult for step {step}: {e}") from None
            elif msg is not None:
                what = f"StepResult for step {msg.step}" if isinstance(msg, StepResult) else type(msg).__name__
                log.warning("dropped a %s from a worker while waiting for step %d", what, step)
