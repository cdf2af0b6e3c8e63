"""The OpenAI server under load: `launch.py` in a subprocess, /v1/completions streamed at concurrency 1, 16
and 64, random token-id prompts, a fixed output length, ignore_eos.

Per level: output tokens/s over the level's wall time; time to first token and inter-token latency (the
gaps between streamed chunks) at p50 and p99; and the CPU each process used over the level's wall time, in
cores (the frontend, scheduler and worker processes, and the client's): which one, if any, is the bottleneck.
Each level sends --rounds x concurrency requests from client processes of --client-streams streams each: one
asyncio client parsing 64 streams used a whole core and took chunks late, in bursts; at 16 streams per process
concurrency 16 and 64 still gained 10% (bench/PERF.md).

    python -m bench.serving
    python -m bench.serving --concurrency 1 64 --json-schema    # every request under BENCH_SCHEMA (issue 34)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np

from bench.common import REPO_DIR, engine_flags, engine_parser, print_table, random_ids, record
from frontend.model_resolution import resolve_model

# Answers as long as free ones: a list of strings that cannot close before 64 of them (random weights closed the
# list without minItems, ~83 of 128 tokens on average, and a throughput of shorter answers compares nothing).
BENCH_SCHEMA = {
    "type": "object",
    "required": ["notes"],
    "properties": {"notes": {"type": "array", "items": {"type": "string"}, "minItems": 64}},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = engine_parser(__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4, help="requests per level = rounds x concurrency")
    p.add_argument("--client-streams", type=int, default=4, help="streams in flight per client process")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for /health")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds a stream may stay silent")
    p.add_argument(
        "--json-schema",
        action="store_true",
        help="constrain every request by response_format json_schema (BENCH_SCHEMA); a request whose "
        "object closes ends early, so compare tok/s",
    )
    return p.parse_args(argv)


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields from the third (state) on: the name before it may hold spaces."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux /proc), 0 once it is gone."""
    try:
        fields = _stat(pid)
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15


def engine_processes(frontend_pid: int) -> dict[str, int]:
    """The server's processes by role: launch.py (the frontend), then its children but multiprocessing's
    resource tracker in the order they started, as frontend/launcher.py starts them: the scheduler, then the
    workers by rank."""
    children = []
    # Each thread's children: the thread that starts the engine need not be the main one.
    threads = Path(f"/proc/{frontend_pid}/task").iterdir()
    for pid in [int(pid) for task in threads for pid in (task / "children").read_text().split()]:
        with contextlib.suppress(FileNotFoundError):
            if "resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_text():
                children.append((int(_stat(pid)[19]), pid))  # field 22: start time
    roles = ["scheduler", *(f"worker{rank}" for rank in range(len(children) - 1))]
    return {"frontend": frontend_pid, **dict(zip(roles, (pid for _, pid in sorted(children))))}


@contextlib.contextmanager
def running_server(args: argparse.Namespace) -> Iterator[tuple[str, int]]:
    """launch.py serving on a free port, its output in a log shown only when it fails; yields the base URL and
    launch.py's pid."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "launch.py",
        "--model",
        args.model,
        *engine_flags(args),
        "--port",
        str(port),
        "--max-model-len",
        str(args.prompt_len + args.output_len),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "server.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO_DIR, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(proc, url, args.startup_timeout, log_path)
            yield url, proc.pid
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"the server was not healthy after {timeout:.0f} s:\n{log_path.read_text()[-3000:]}")


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], args: argparse.Namespace) -> dict:
    """One streamed completion: arrival times of its chunks and its completion token count."""
    body = {
        "model": args.model,
        "prompt": prompt,
        "max_tokens": args.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.json_schema:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": BENCH_SCHEMA}}
    start, arrivals, tokens = time.perf_counter(), [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']}")
            if chunk.get("choices"):
                arrivals.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"ttft": arrivals[0] - start, "itl": np.diff(arrivals).tolist(), "tokens": tokens}


async def stream_all(
    url: str, prompts: list[list[int]], concurrency: int, args: argparse.Namespace, ready: Callable[[], None]
) -> list[dict]:
    """Every prompt streamed, at most `concurrency` in flight; ready() runs once the client is set up."""
    gate = asyncio.Semaphore(concurrency)
    timeout = httpx.Timeout(args.request_timeout, pool=None)  # a stalled stream fails instead of hanging
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:

        async def gated(prompt: list[int]) -> dict:
            async with gate:
                return await one_request(client, url, prompt, args)

        ready()
        return await asyncio.gather(*(gated(p) for p in prompts))


def client_process(
    url: str, prompts: list[list[int]], concurrency: int, args: argparse.Namespace, barrier, results
) -> None:
    """One client process: sets up, waits for the others, then puts (its requests' results, its CPU seconds
    from then on), or the error that stopped it."""
    started = []

    def ready() -> None:
        barrier.wait()
        started.append(time.process_time())

    try:
        out = asyncio.run(stream_all(url, prompts, concurrency, args, ready))
        results.put((out, time.process_time() - started[0]))
    except Exception as e:  # the parent waits on the queue: it must hear of a failure
        results.put(RuntimeError(f"a client process failed: {e!r}"))


def run_level(
    url: str, prompts: list[list[int]], concurrency: int, args: argparse.Namespace, processes: dict[str, int]
) -> dict:
    """All prompts, at most `concurrency` in flight over ceil(concurrency / --client-streams) client processes;
    the CPU cores `processes` (role -> pid) and the clients used over the level."""
    n = -(-concurrency // args.client_streams)
    ctx = multiprocessing.get_context("fork")  # no CUDA and no running event loop in this process
    barrier, queue = ctx.Barrier(n + 1, timeout=60), ctx.Queue()
    clients = [
        ctx.Process(
            target=client_process,
            daemon=True,
            args=(url, prompts[i::n], concurrency // n + (i < concurrency % n), args, barrier, queue),
        )
        for i in range(n)
    ]
    for client in clients:
        client.start()
    barrier.wait()
    start, cpu_start = time.perf_counter(), {role: cpu_seconds(pid) for role, pid in processes.items()}
    outs = [queue.get() for _ in clients]
    wall = time.perf_counter() - start
    for out in outs:
        if isinstance(out, Exception):
            raise out
    cpu = {f"{role}_cpu": (cpu_seconds(pid) - cpu_start[role]) / wall for role, pid in processes.items()}
    for client in clients:
        client.join()
    results = [r for out, _ in outs for r in out]
    ttft = [r["ttft"] * 1e3 for r in results]
    itl = [gap * 1e3 for r in results for gap in r["itl"]] or [float("nan")]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "client_procs": n,
        "output_tok_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p99_ms": float(np.percentile(ttft, 99)),
        "itl_p50_ms": float(np.percentile(itl, 50)),
        "itl_p99_ms": float(np.percentile(itl, 99)),
        **cpu,
        "client_cpu": sum(c for _, c in outs) / wall,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vocab = resolve_model(args.model, args.load_format)[0].vocab_size
    rng = random.Random(args.seed)
    rows = []
    with running_server(args) as (url, pid):
        # Warm-up, in this process: the clients forked later find httpx's lazily imported modules loaded.
        asyncio.run(stream_all(url, [random_ids(rng, args.prompt_len, vocab)], 1, args, lambda: None))
        processes = engine_processes(pid)
        for concurrency in args.concurrency:
            prompts = [random_ids(rng, args.prompt_len, vocab) for _ in range(args.rounds * concurrency)]
            rows.append(run_level(url, prompts, concurrency, args, processes))
    constrained = " under a JSON schema" if args.json_schema else ""
    print_table(
        f"serving: {args.model}, prompts of {args.prompt_len} random tokens, {args.output_len} "
        f"output tokens each{constrained}",
        rows,
    )
    record("serving-json" if args.json_schema else "serving", args, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
