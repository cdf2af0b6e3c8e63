"""Step-latency tracing in every process, and the trace file each one writes (the frontend merges them).
Spans (name, start, duration, step) are on `time.perf_counter_ns`, one monotonic clock for all processes of a
host. When tracing is off, `span()` hands back one shared no-op object: no clock read, no allocation."""

from __future__ import annotations

import json
import os
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext

_OFF = nullcontext()
GPU_TRACK = 1  # tid of the worker's GPU spans; CPU spans use tid 0
DECODE_GPU_SPAN = "gpu.decode"


class Tracer:
    """Spans of one process. `with tracer.span("schedule", step):` or `tracer.record(...)` for known times."""

    def __init__(self, process: str, trace_dir: str | None) -> None:
        self.process, self.trace_dir = process, trace_dir
        self.events: list[tuple[str, int, int, int, int]] = []

    def span(self, name: str, step: int = -1) -> AbstractContextManager:
        return _OFF if self.trace_dir is None else self._timed(name, step)

    @contextmanager
    def _timed(self, name: str, step: int):
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            self.record(name, start, time.perf_counter_ns() - start, step)

    def record(self, name: str, start_ns: int, dur_ns: int, step: int = -1, track: int = 0) -> None:
        self.events.append((name, start_ns, dur_ns, step, track))

    def flush(self) -> None:
        """Write this process's spans as `<process>-<pid>.json` in the trace dir."""
        if self.trace_dir is None:
            return
        os.makedirs(self.trace_dir, exist_ok=True)
        pid = os.getpid()
        events = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": self.process}}]
        span = {"ph": "X", "pid": pid, "cat": self.process}  # what every complete event shares
        events += [
            {**span, "name": n, "ts": s / 1000, "dur": d / 1000, "tid": t, "args": {"step": st}}
            for n, s, d, st, t in self.events
        ]
        path = os.path.join(self.trace_dir, f"{self.process}-{pid}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"traceEvents": events}, f)
        os.replace(path + ".tmp", path)
