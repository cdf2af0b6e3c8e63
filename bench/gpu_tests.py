"""Run the GPU tests (`pytest -m gpu tests`) and record every test's outcome beside the benchmarks.

python -m bench.gpu_tests --out bench/results
"""

from __future__ import annotations

import argparse
import sys
import time

import pytest

from bench.common import RESULTS_DIR, record


class _Outcomes:
    """pytest plugin: the outcome of each test (a failed setup counts as the test's outcome; a module skipped
    while collecting counts as one skipped, as pytest's summary counts it), and the error's last line for each
    module that failed to collect (its GPU tests, if any, did not run)."""

    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}
        self.collect_errors: dict[str, str] = {}

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.nodeid] = report.outcome

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self.collect_errors[report.nodeid] = str(report.longrepr).strip().splitlines()[-1]
        elif report.skipped:
            self.outcomes[report.nodeid] = "skipped"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(RESULTS_DIR), help="folder the result JSON is written to")
    args = p.parse_args(argv)
    plugin, start = _Outcomes(), time.perf_counter()
    # A module that cannot import here (the GPU image lacks a CPU-only test's client) must not hide the rest.
    code = pytest.main(
        ["-q", "-m", "gpu", "-p", "no:cacheprovider", "--continue-on-collection-errors", "tests"], plugins=[plugin]
    )
    counts = {k: sum(v == k for v in plugin.outcomes.values()) for k in ("passed", "failed", "skipped")}
    record(
        "gpu-tests",
        args,
        {
            "exit_code": int(code),
            "wall_s": time.perf_counter() - start,
            **counts,
            "tests": plugin.outcomes,
            "collect_errors": plugin.collect_errors,
        },
    )
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
