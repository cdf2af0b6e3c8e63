"""Faults: a killed worker or scheduler, a killed or terminated launch.py, a step that never ends.

Each test starts its own server (a fault ends it). Requests are made long (4000 tokens, about 15 s on
the tiny model) so that they are surely pending when the fault strikes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.reliability.harness import AUTH, children, gone, running_server, tmp_of, wait_until
from tests.server_fixture import REPO
from tests.test_server import MODEL

LONG_CONTEXT = ("--max-model-len", "4096")
LONG = 4000


class Pending:
    """A request running in a thread: its status, the lines of its body, and when it ended."""

    def __init__(self, url: str, stream: bool, max_tokens: int = LONG) -> None:
        self.body = {
            "model": MODEL,
            "prompt": "Hello world",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }
        self.url, self.lines, self.status, self.error, self.ended = url, [], None, None, None
        self.first_line = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, headers=AUTH, timeout=60) as resp:
                self.status = resp.status_code
                for line in resp.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.first_line.set()
        except httpx.HTTPError as e:
            self.error = e
        finally:
            self.ended = time.monotonic()
            self.first_line.set()

    def wait_started(self) -> None:
        assert self.first_line.wait(60) and self.ended is None, f"request ended early: {self.lines[-2:]}"

    def wait_ended(self, timeout: float) -> float:
        return wait_until(lambda: self.ended is not None, timeout, "a pending request did not end")

    def error_message(self) -> str:
        """The error a failed request carried: its JSON body, or the error event of its stream."""
        for line in reversed(self.lines):
            body = json.loads(line.removeprefix("data: ")) if line != "data: [DONE]" else {}
            if "error" in body:
                return body["error"]["message"]
        raise AssertionError(f"no error in the response: {self.lines[-2:]}")


def test_launch_logs_each_child_role_and_pid_once(tiny_ckpt, tmp_path):
    with running_server(tiny_ckpt, tmp_path) as server:
        lines = re.findall(r"^.*\b(scheduler|worker\d+) pid=(\d+)$", server.log.read_text(), re.M)
        assert [role for role, _ in lines] == ["scheduler", "worker0"]
        assert {int(pid) for _, pid in lines} <= set(children(server.proc.pid))


@pytest.mark.parametrize("role", ["worker0", "scheduler"])
def test_sigkill_of_an_engine_process_fails_pending_requests_then_launch_exits_nonzero(tiny_ckpt, tmp_path, role):
    with running_server(tiny_ckpt, tmp_path, *LONG_CONTEXT) as server:
        pid = server.child_pids()[role]
        stream = Pending(server.url, stream=True)
        stream.wait_started()
        plain = Pending(server.url, stream=False)
        time.sleep(0.5)  # the plain request is in the engine too by now
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        for request in (stream, plain):
            request.wait_ended(5)
            assert request.ended - killed < 5
            assert f"engine is dead: engine process {role} (pid {pid})" in request.error_message()
        assert plain.status == 503 and stream.status == 200  # a stream's 200 was sent before the fault
        assert httpx.get(server.url + "/health").status_code == 503
        assert server.proc.wait(max(0.1, 10 - (time.monotonic() - killed))) == 1
        assert wait_until(lambda: all(gone(p) for p in server.child_pids().values()), 2, "a child outlived launch.py")


def test_sigkill_of_launch_py_ends_every_child_within_10_s(tiny_ckpt, tmp_path):
    with running_server(tiny_ckpt, tmp_path) as server:
        kids = children(server.proc.pid)
        assert set(server.child_pids().values()) <= set(kids)
        server.proc.kill()
        server.proc.wait()
        wait_until(lambda: all(gone(pid) for pid in kids), 10, "a child outlived launch.py's SIGKILL")
        assert list(tmp_of(server).iterdir()) == []  # the scheduler took the ipc directory with it


SPAWN_AND_SLEEP = """
import sys, time
from frontend.launcher import EngineProcesses
from frontend.model_resolution import resolve_config
from protocol.config import EngineConfig
if __name__ == "__main__":
    procs = EngineProcesses(resolve_config(EngineConfig(sys.argv[1], device="cpu", num_kv_blocks=64)))
    procs.start()
    print(*(p.pid for p in procs.procs.values()), flush=True)
    time.sleep(60)
"""


def test_a_worker_exits_when_its_launcher_dies_before_it_has_started(tiny_ckpt, tmp_path):
    """The launcher and the scheduler die as soon as the worker is spawned, before its imports are done:
    with no scheduler to send it Shutdown, the worker must see by itself that its parent is gone."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", SPAWN_AND_SLEEP, str(tiny_ckpt)],
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    scheduler, worker = (int(pid) for pid in launcher.stdout.readline().split())
    os.kill(scheduler, signal.SIGKILL)
    launcher.kill()
    launcher.wait()
    try:
        wait_until(lambda: gone(worker), 10, "the worker outlived its launcher")
    finally:
        if not gone(worker):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 130)])
def test_sigterm_ends_in_flight_requests_as_abort_within_the_timeout_and_leaves_nothing(
    tiny_ckpt, tmp_path, sig, status
):
    """Each open stream gets a last chunk with finish_reason "abort" and [DONE], a plain request its partial
    answer; uvicorn never cancels one mid-body (it used to log 'Exception in ASGI application' and cut bodies)."""
    shutdown_timeout = 8.0
    with running_server(tiny_ckpt, tmp_path, *LONG_CONTEXT, "--shutdown-timeout", str(shutdown_timeout)) as server:
        kids = children(server.proc.pid)
        endless, plain = Pending(server.url, stream=True), Pending(server.url, stream=False)
        endless.wait_started()
        short = Pending(server.url, stream=True, max_tokens=30)  # 0.2 s, 7 s left: it finishes, even under load
        short.wait_started()
        server.proc.send_signal(sig)  # SIGINT: Ctrl-C
        termed = time.monotonic()
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # a new request is refused
            httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi"}, headers=AUTH)
        for request in (endless, plain):
            request.wait_ended(shutdown_timeout + 5)
            assert request.error is None and request.status == 200
            assert request.ended - termed < shutdown_timeout + 1.5  # aborted half a second before the timeout
        assert endless.lines[-1] == "data: [DONE]"
        last = json.loads(endless.lines[-2][len("data: ") :])
        assert last["choices"][0]["finish_reason"] == "abort" and "error" not in last
        answer = json.loads(plain.lines[0])["choices"][0]
        assert answer["finish_reason"] == "abort" and answer["text"]  # what it had generated by then
        assert json.loads(short.lines[-2][len("data: ") :])["choices"][0]["finish_reason"] == "length"
        assert short.lines[-1] == "data: [DONE]"
        assert server.proc.wait(max(0.1, shutdown_timeout + 8 - (time.monotonic() - termed))) == status
        assert all(gone(pid) for pid in server.child_pids().values())  # joined before launch.py exits
        wait_until(lambda: all(gone(pid) for pid in kids), 2, "a child outlived launch.py's signal")
        assert list(tmp_of(server).iterdir()) == []  # the ipc directory is gone
        log = server.log.read_text()
        assert "ERROR" not in log and "Traceback" not in log, log[-3000:]
        assert "scheduler stopping: a frontend asked to shut down" in log  # stopped in order, not terminated


def test_sigterm_while_the_engine_loads_leaves_no_process_and_no_ipc_file(tiny_ckpt, tmp_path):
    with running_server(tiny_ckpt, tmp_path, ready=False) as server:
        server.wait_listening()  # /health answers 503: the engine is loading
        kids = children(server.proc.pid)
        server.proc.terminate()
        server.proc.wait(10)
        wait_until(lambda: all(gone(pid) for pid in kids), 10, "a child outlived launch.py's SIGTERM")
        assert list(tmp_of(server).iterdir()) == []


def test_a_stuck_worker_marks_the_engine_dead_after_step_timeout(tiny_ckpt, tmp_path):
    with running_server(tiny_ckpt, tmp_path, *LONG_CONTEXT, "--step-timeout", "2") as server:
        stream = Pending(server.url, stream=True)
        stream.wait_started()
        os.kill(server.child_pids()["worker0"], signal.SIGSTOP)  # alive, holding its sockets, doing nothing
        stopped = time.monotonic()
        stream.wait_ended(8)
        # the timeout counts from the last result, which came a step (on a loaded machine, a few) before SIGSTOP
        assert 1.5 <= stream.ended - stopped < 6
        assert "no progress for 2.0 s (step_timeout)" in stream.error_message()
        assert httpx.get(server.url + "/health").status_code == 503
        assert server.proc.wait(max(0.1, 12 - (time.monotonic() - stopped))) == 1
