"""`launch.py` as a real subprocess (tests only): start it on a free port, wait for /health, stop it.

Shared by the end-to-end server tests and the reliability tests, which need several servers with
different flags.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll_health(
    url: str, proc: subprocess.Popen, log: Path, done: Callable[[int], bool], timeout: float = 240.0
) -> list[int]:
    """Poll /health until done(status); return every status seen (503 while the engine loads)."""
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            seen.append(httpx.get(f"{url}/health", timeout=2).status_code)
            if done(seen[-1]):
                return seen
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"server not healthy after {timeout} s:\n{log.read_text()[-3000:]}")


@dataclass
class ServerProcess:
    url: str
    port: int
    proc: subprocess.Popen
    log: Path

    def child_pids(self) -> dict[str, int]:
        """{role: pid} from launch.py's start-up lines (`scheduler pid=N`, `worker0 pid=N`)."""
        return {role: int(pid) for role, pid in re.findall(r"\b(scheduler|worker\d+) pid=(\d+)", self.log.read_text())}

    def wait_healthy(self, timeout: float = 240.0) -> None:
        poll_health(self.url, self.proc, self.log, lambda status: status == 200, timeout)

    def wait_listening(self, timeout: float = 240.0) -> int:
        """The first /health status (503 while the engine loads)."""
        return poll_health(self.url, self.proc, self.log, lambda status: True, timeout)[-1]

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not go within `timeout`; the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def launch(args: list[str], log: Path, env: dict[str, str] | None = None) -> ServerProcess:
    """Start `python launch.py ARGS --port P` (output to `log`); it is not ready yet."""
    port = free_port()
    with open(log, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "launch.py", *args, "--port", str(port)],
            cwd=REPO,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    return ServerProcess(f"http://127.0.0.1:{port}", port, proc, log)


def post(url: str, path: str, body, key: str | None = None, **kw) -> httpx.Response:
    """POST JSON (or raw bytes) with an optional bearer key."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    kw.setdefault("timeout", 60)
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body, headers=headers, **kw)
    return httpx.post(url + path, json=body, headers=headers, **kw)


def assert_error(resp: httpx.Response, status: int, param: str | None) -> None:
    """OpenAI's error body with this status (and param), short: never the whole input back."""
    assert resp.status_code == status, resp.text[:500]
    assert len(resp.content) < 2000
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error


def readme_snippet(marker: str, url: str, model: str, key: str) -> str:
    """The README's Python snippet that holds `marker`, pointed at this server, its model and its key."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    (code,) = [block for block in blocks if marker in block]
    code = code.replace("http://127.0.0.1:8000", url).replace("qwen2.5-1.5b", model)
    return code.replace('api_key="unused"', f"api_key={key!r}")
