"""The frontend's side of the engine (started here or remote): socket, handshake, tokenizer, prompt checks."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import zmq

from frontend.launcher import EngineProcesses, cached_bytecode
from frontend.tokenizer import load_tokenizer
from protocol.codec import ProtocolError, decode, encode
from protocol.config import EngineConfig, InvalidParam, ModelConfig
from protocol.messages import READY_TIMEOUT_S, EngineDead, GetStats, Ready, Shutdown
from protocol.sampling import SamplingParams, check_length, check_prompt
from protocol.tracing import DECODE_GPU_SPAN, Tracer

log = logging.getLogger("pico_vllm.frontend")
SHUTDOWN_LINGER_MS = 1000  # time for our last message (Shutdown) to leave when we close
Prompt = str | list[int]


class EngineDeadError(RuntimeError):
    """The engine's scheduler or a worker died; every pending request fails with this."""


class EngineClient:
    """Starts an engine from a resolved config, or attaches to one at `address`, and waits for its Ready."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        address: str | None = None,
        ready_timeout: float = READY_TIMEOUT_S,
        cancel: threading.Event | None = None,
    ) -> None:
        self.procs: EngineProcesses | None = None
        self.trace_dir = config.trace_dir if config is not None else None
        self.clock: dict[str, float] = {}  # wall-clock marks of the start-up, for bench/startup
        self.tracer = Tracer("frontend", self.trace_dir)
        self.cancel = cancel or threading.Event()  # set by another thread: stop waiting for Ready (server shutdown)
        if config is not None:
            self.procs = EngineProcesses(config, address)
            address = self.procs.addresses.engine
        self.address = address
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, self.procs.owner if self.procs else uuid.uuid4().bytes)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        try:
            if self.procs is not None:
                self.procs.start()
            self.send(GetStats())  # hello: the scheduler answers Ready once the workers are up
            with cached_bytecode():  # transformers' imports: the last thing a warm launch waits for
                self.tokenizer = load_tokenizer(config.model, config.model_path) if config else None
            self.clock["tokenizer_loaded"] = time.time()
            self.info = self._wait_ready(ready_timeout)
            self.clock["engine_ready"] = time.time()
            if self.tokenizer is None:
                self.tokenizer = load_tokenizer(self.info["model"], self.info.get("model_path"))
        except BaseException:  # Ctrl-C too: an engine not ready has nothing to finish, so it is stopped at once
            self.close(0.0)
            raise
        self.model_config = ModelConfig.from_dict(self.info["model_config"])
        self.max_model_len: int = self.info["max_model_len"]

    def _wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.cancel.is_set():
            if self.procs is not None and not self.procs.alive:
                raise EngineDeadError(f"engine failed to start: {self.procs.dead_reason or 'a process exited'}")
            if not self.sock.poll(200):
                continue
            try:
                msg = decode(self.sock.recv())
            except ProtocolError as e:  # another protocol version, or not an engine: waiting cannot help
                raise EngineDeadError(
                    f"the peer at {self.address} sent a frame this frontend cannot read ({e}): "
                    "connect to a Pico-vLLM engine of the same protocol version"
                ) from None
            if isinstance(msg, Ready) and msg.role == "engine":
                return msg.info
            if isinstance(msg, EngineDead):
                raise EngineDeadError(f"engine failed to start: {msg.reason}")
        if self.cancel.is_set():
            raise EngineDeadError("the engine's start-up was cancelled")
        if self.procs is None:
            raise EngineDeadError(
                f"no engine answered at {self.address} within {timeout:g} s: start one with "
                f"`launch.py --headless --engine-address {self.address}` or fix the address"
            )
        raise EngineDeadError(f"engine at {self.address} was not ready after {timeout:.0f} s")

    def prepare(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        """(text, token ids), checked as the scheduler checks them; InvalidParam names the field and the fix."""
        vocab_size = self.model_config.vocab_size
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidParam("prompt", "prompt is empty: send at least one character or token id")
            text, ids = prompt, self.tokenizer.encode(prompt)  # the tokenizer's own specials: Llama 3's BOS
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, ids = None, check_prompt(prompt, vocab_size)
        else:
            raise InvalidParam(
                "prompt", f"prompt must be a str or a list of int token ids, got {type(prompt).__name__}"
            )
        params.check_vocab(vocab_size)
        check_length(len(ids), params.max_tokens, self.max_model_len)
        return text, ids

    def send(self, msg: object) -> None:
        self.sock.send(encode(msg))

    def decode(self, frame: bytes) -> object:
        """The message, or None for a malformed frame (logged, never fatal)."""
        with self.tracer.span("frontend.receive"):
            try:
                return decode(frame)
            except ProtocolError as e:
                log.warning("dropped a malformed frame from the engine: %s", e)
                return None

    def recv_blocking(self) -> object:
        """The next message; EngineDeadError when the engine dies meanwhile (no hang)."""
        while not self.sock.poll(500):
            if self.dead_reason:
                raise EngineDeadError(self.dead_reason)
        msg = self.decode(self.sock.recv())
        if isinstance(msg, EngineDead):
            raise EngineDeadError(msg.reason)
        return msg

    @property
    def dead_reason(self) -> str | None:
        return self.procs.dead_reason if self.procs is not None else None

    def close(self, timeout: float = 5.0) -> None:
        """Stop the engine we started (nothing when attached to a remote one) and close the socket; timeout 0
        terminates it at once, with no Shutdown (which could race the SIGTERM)."""
        linger_ms = 0
        if self.procs is not None and not self.sock.closed and timeout > 0:
            with contextlib.suppress(zmq.ZMQError):
                self.send(Shutdown())
                # With no linger close() may drop the queued Shutdown, and the scheduler waits to be terminated.
                linger_ms = 0 if self.dead_reason else SHUTDOWN_LINGER_MS
        if not self.sock.closed:
            self.sock.close(linger=linger_ms)
        if self.procs is not None:
            self.procs.shutdown(timeout)
            self.procs = None
        self.ctx.term()
        if self.trace_dir is not None:
            self.tracer.flush()
            merge_traces(self.trace_dir)  # every child has flushed its own file by now
            self.trace_dir = None


def merge_traces(trace_dir: str) -> None:
    """trace.json (every process's trace, for Perfetto) and summary.txt (per stage p50/p90/p99 µs, GPU idle)."""
    files = sorted(Path(trace_dir).glob("*-*.json"))  # each process's own trace
    events = [e for path in files for e in json.loads(path.read_text())["traceEvents"]]
    Path(trace_dir, "trace.json").write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ns"}))
    spans, timed = {}, [e for e in events if e.get("ph") == "X"]  # (process, stage) -> µs; events with a duration
    for e in timed:
        spans.setdefault((e["cat"], e["name"]), []).append(e["dur"])
    lines = [f"{'process':<12} {'stage':<22} {'count':>7} {'p50 us':>10} {'p90 us':>10} {'p99 us':>10}"]
    for (proc, name), durs in sorted(spans.items()):
        p50, p90, p99 = np.percentile(durs, [50, 90, 99])
        lines.append(f"{proc:<12} {name:<22} {len(durs):>7} {p50:>10.1f} {p90:>10.1f} {p99:>10.1f}")
    decode = sorted((e["args"]["step"], e["ts"], e["ts"] + e["dur"]) for e in timed if e["name"] == DECODE_GPU_SPAN)
    # Only back-to-back decode steps count: a prefill step between two of them is work, not idle time.
    pairs = [(a, b) for a, b in zip(decode, decode[1:]) if b[0] == a[0] + 1]
    if not pairs:
        lines.append("gpu idle between decode steps: n/a (no two consecutive GPU-timed decode steps)")
    else:
        gaps = np.array([max(0.0, b[1] - a[2]) for a, b in pairs])
        share = 100.0 * gaps.sum() / (gaps.sum() + sum(b[2] - b[1] for _, b in pairs))
        p50, p99 = np.percentile(gaps, [50, 99])
        lines.append(
            f"gpu idle between decode steps: {share:.2f}% of decode time, gap p50 {p50:.1f} us, "
            f"p99 {p99:.1f} us over {len(gaps)} gaps"
        )
    Path(trace_dir, "summary.txt").write_text("\n".join(lines) + "\n")
