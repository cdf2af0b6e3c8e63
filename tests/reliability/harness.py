"""What the reliability tests share: a launch.py server with a private TMPDIR, engine stats read from
/metrics, and process checks by pid (through /proc, so that a zombie counts as gone).

Every server runs the tiny checkpoint on the CPU under test_server.py's model name, key and context
length, so that its bad-input table applies unchanged.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.server_fixture import ServerProcess, launch
from tests.test_server import KEY, MAX_MODEL_LEN, MODEL

AUTH = {"Authorization": f"Bearer {KEY}"}


@contextmanager
def running_server(ckpt: Path, workdir: Path, *flags: str, ready: bool = True) -> Iterator[ServerProcess]:
    """launch.py with TMPDIR=workdir/tmp (its ipc directory lands there); stopped and reaped on exit."""
    (workdir / "tmp").mkdir(parents=True)
    args = [
        "--model",
        str(ckpt),
        "--device",
        "cpu",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--num-kv-blocks",
        "1024",
        "--served-model-name",
        MODEL,
        "--api-key",
        KEY,
        *flags,
    ]
    server = launch(args, workdir / "server.log", env={"TMPDIR": str(workdir / "tmp")})
    try:
        if ready:
            server.wait_healthy(120)
        yield server
    finally:
        pids = list(server.child_pids().values())
        server.stop()
        for pid in pids:  # a fault test may leave a child stopped (SIGSTOP) or orphaned: ours to end
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def tmp_of(server: ServerProcess) -> Path:
    return server.log.parent / "tmp"


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of a process, None when there is no such process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[1])


def gone(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is None or stat[0] in "ZX"


def children(pid: int) -> list[int]:
    """Live processes whose parent is `pid`."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = proc_stat(int(entry.name))
            if stat is not None and stat[1] == pid and stat[0] not in "ZX":
                kids.append(int(entry.name))
    return kids


def wait_until(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> float:
    """Seconds until `condition()` held; AssertionError naming `what` after `timeout`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - start


def engine_stats(server: ServerProcess) -> dict[str, float]:
    """The engine gauges of /metrics (a fresh round trip to the scheduler): running, waiting, kv usage."""
    text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=10).text
    out = {}
    for key, name in (
        ("running", "num_requests_running"),
        ("waiting", "num_requests_waiting"),
        ("kv_usage", "kv_cache_usage_perc"),
    ):
        match = re.search(rf'^vllm:{name}{{model_name="{MODEL}"}} (\S+)$', text, re.M)
        assert match, f"vllm:{name} not in /metrics"
        out[key] = float(match.group(1))
    return out


def wait_idle(server: ServerProcess, timeout: float) -> float:
    """Seconds until no request runs or waits and every KV block is free."""
    return wait_until(
        lambda: engine_stats(server) == {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0},
        timeout,
        "the engine still holds requests or KV blocks",
        interval=0.2,
    )


def completion(
    server: ServerProcess, prompt: str | list[int], max_tokens: int, timeout: float = 60, **fields
) -> httpx.Response:
    """A greedy /v1/completions request that runs to max_tokens (EOS ignored)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **fields}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=timeout)
