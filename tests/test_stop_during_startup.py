"""Ctrl-C or SIGTERM while launch.py is still starting ends it quietly: no ERROR, no traceback, no process left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _processes() -> list[dict[str, str]]:
    """/proc/PID/status of every process, as a map (Pid, PPid, NSpgid, SigIgn, ...)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            found.append(dict(line.split(":\t", 1) for line in (entry / "status").read_text().splitlines()))
        except (OSError, ValueError):  # not a process, or one that has just gone
            pass
    return found


def _wait_until(ready, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.05)


def _wait_for_the_imports(pid: int) -> None:
    """Until launch.py runs its own first lines (its SIGTERM handler is set): a signal before that, while Python
    still imports `site`, ends the interpreter with its own status 1, which no code of ours can change."""
    mask = 1 << (signal.SIGTERM - 1)
    _wait_until(lambda: any(p.get("Pid") == str(pid) and int(p["SigCgt"], 16) & mask for p in _processes()), "launch")


def _wait_for_the_engine_loading(pid: int) -> None:
    """Until the scheduler and the worker run our code (a child ignores SIGINT from its first line)."""

    def loading() -> bool:
        kids = [p for p in _processes() if p.get("PPid") == str(pid)]
        return len(kids) == 2 and all(int(k["SigIgn"], 16) & 1 << (signal.SIGINT - 1) for k in kids)

    _wait_until(loading, "the engine's children starting")


@pytest.mark.parametrize(
    "sig, when, status",
    [
        (signal.SIGINT, "importing", 130),  # launch.py is still importing its modules
        (signal.SIGINT, "engine loading", 130),
        (signal.SIGTERM, "engine loading", -signal.SIGTERM),  # ends by the signal, as a supervisor expects
        (signal.SIGINT, "one prompt's engine loading", 130),
    ],
)
def test_stopping_during_start_up_logs_no_error_and_leaves_no_process(tiny_ckpt, tmp_path, sig, when, status):
    argv = ["--model", str(tiny_ckpt), "--device", "cpu", "--port", "0"]
    if when == "one prompt's engine loading":
        argv += ["--prompt", "Hello"]
    log = tmp_path / "stderr.txt"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "launch.py", *argv],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,  # a group of its own, as a terminal's job: Ctrl-C reaches every process in it
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # pytest's may ignore it; a terminal not
        )
    try:
        if when == "importing":
            _wait_for_the_imports(proc.pid)
        else:
            _wait_for_the_engine_loading(proc.pid)
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # what Ctrl-C does
        else:
            proc.send_signal(sig)  # what a supervisor does
        assert proc.wait(30) == status
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stderr = log.read_text()
    assert "ERROR" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    time.sleep(0.2)  # a child that outlived launch.py would still be here
    assert [p["Pid"] for p in _processes() if p.get("NSpgid") == str(proc.pid)] == []
