"""Our commands end quietly: no Triton `nanobind: leaked ...` lines and no traceback on a normal exit."""

from __future__ import annotations

import subprocess
import sys


def test_one_prompt_run_leaves_no_leak_warnings_or_tracebacks_on_stderr(tiny_ckpt):
    run = subprocess.run(
        [
            sys.executable,
            "launch.py",
            "--model",
            str(tiny_ckpt),
            "--device",
            "cpu",
            "--prompt",
            "Hello",
            "--max-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()  # the completion
    assert "nanobind" not in run.stderr and "leaked" not in run.stderr, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
