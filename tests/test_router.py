"""Data parallel behind an existing router: two engines (tiny checkpoint, CPU) behind sglang-router's cache-aware
policy, everything on loopback. The router reads what it reads of vLLM (/health); each replica's /metrics shows
where the traffic went."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_fixture import ServerProcess, free_port, launch

pytest.importorskip("sglang_router", reason="the router under test: pip install sglang-router (the [router] extra)")

MODEL = "tiny"
# A prompt the router has seen makes it pick that prompt's replica: each test's prompts start with words of its own.
PREFIX = "Paged attention stores keys and values in fixed-size blocks. " * 6


@dataclass
class Cluster:
    url: str
    router: subprocess.Popen
    replicas: list[ServerProcess]


def _start_router(urls: list[str], log: Path) -> tuple[str, subprocess.Popen]:
    """sglang-router on loopback (it binds 0.0.0.0 by default, its metrics too); no retries, so that a dead
    replica's requests fail rather than run again elsewhere; health checked every second."""
    port = free_port()
    args = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", "cache_aware"]
    args += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--disable-retries"]
    args += ["--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--log-level", "warn"]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", *args], stdout=out, stderr=subprocess.STDOUT
        )
    return f"http://127.0.0.1:{port}", proc


def _healthy_workers(url: str) -> set[str]:
    try:
        workers = httpx.get(f"{url}/workers", timeout=2).json()["workers"]
    except (httpx.TransportError, ValueError):
        return set()
    return {w["url"] for w in workers if w["is_healthy"]}


def _wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(tiny_ckpt, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("router")
    args = ["--model", str(tiny_ckpt), "--device", "cpu", "--served-model-name", MODEL, "--max-model-len", "2048"]
    replicas = [launch(args + ["--num-kv-blocks", "512"], workdir / f"replica{i}.log") for i in range(2)]
    router = None
    try:
        for replica in replicas:
            replica.wait_healthy(240)
        url, router = _start_router([r.url for r in replicas], workdir / "router.log")
        _wait_until(lambda: len(_healthy_workers(url)) == 2, 60, "the router never saw both replicas healthy")
        yield Cluster(url, router, replicas)
    finally:
        if router is not None:
            router.terminate()
            try:
                router.wait(10)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait()
        for replica in replicas:
            replica.stop()


def _metric(replica: ServerProcess, name: str, **labels: str) -> float:
    """One sample of the replica's /metrics, labelled with our model's name (and `labels`)."""
    text = httpx.get(f"{replica.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == {"model_name": MODEL, **labels}:
                return sample.value
    raise AssertionError(f"{name} {labels} not in {replica.url}/metrics")


def _finished(replica: ServerProcess) -> float:
    """Requests the replica finished (every request here ignores EOS, so each ends by length)."""
    return _metric(replica, "vllm:request_success_total", finished_reason="length")


def _complete(url: str, prompt: str, max_tokens: int = 32, timeout: float = 120) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def _in_parallel(url: str, prompts: list[str], max_tokens: int = 32) -> list[httpx.Response]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _complete(url, p, max_tokens), prompts))


def test_replicas_serve_the_router_and_export_vllms_gauges(cluster):
    for replica in cluster.replicas:
        assert httpx.get(f"{replica.url}/health").status_code == 200
        assert [m["id"] for m in httpx.get(f"{replica.url}/v1/models").json()["data"]] == [MODEL]
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "gpu_cache_usage_perc"):
            assert _metric(replica, f"vllm:{name}") >= 0


def test_concurrent_requests_spread_over_both_replicas(cluster):
    before = [_finished(r) for r in cluster.replicas]
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    responses = _in_parallel(cluster.url, [f"{w} {i} is a word of its own" for i, w in enumerate(words)], 64)
    assert [r.status_code for r in responses] == [200] * len(words)
    served = [_finished(r) - b for r, b in zip(cluster.replicas, before)]
    assert sum(served) == len(words) and min(served) >= 1, served


def test_a_shared_long_prefix_lands_on_the_replica_that_holds_it(cluster):
    before = [_finished(r) for r in cluster.replicas]
    assert _complete(cluster.url, PREFIX + "Which replica holds this?").status_code == 200
    holder = next(i for i, r in enumerate(cluster.replicas) if _finished(r) > before[i])
    before = [_finished(r) for r in cluster.replicas]
    hits = _metric(cluster.replicas[holder], "vllm:prefix_cache_hits_total")
    questions = [PREFIX + f"Question {i}: what follows?" for i in range(6)]
    assert [r.status_code for r in _in_parallel(cluster.url, questions)] == [200] * len(questions)
    served = [_finished(r) - b for r, b in zip(cluster.replicas, before)]
    assert served[holder] == len(questions) and served[1 - holder] == 0, served  # concurrent, yet on one replica
    assert _metric(cluster.replicas[holder], "vllm:prefix_cache_hits_total") > hits  # its KV cache held the prefix


def test_a_killed_replica_fails_only_its_own_requests_and_the_other_serves_the_rest(cluster):
    """Last in this file: it kills replica 1."""
    prompts = [f"{w} runs long before the kill" for w in ("kilo", "lima", "mike", "november")]
    with ThreadPoolExecutor(len(prompts)) as pool:
        pending = [pool.submit(_timed, cluster.url, p) for p in prompts]
        in_flight = [0, 0]

        def both_busy() -> bool:
            in_flight[:] = [int(_metric(r, "vllm:num_requests_running")) for r in cluster.replicas]
            return min(in_flight) >= 1 and sum(in_flight) == len(prompts)

        _wait_until(both_busy, 60, f"the requests never ran on both replicas at once: {in_flight}")
        cluster.replicas[1].proc.kill()  # SIGKILL: launch.py's children follow it within seconds
        killed = time.monotonic()
        ended = [future.result() for future in pending]
    failed = [(status, at - killed) for status, at in ended if status != 200]
    assert len(ended) - len(failed) == in_flight[0] and len(failed) == in_flight[1], ended
    assert all(status >= 500 and after < 10 for status, after in failed), failed  # an HTTP error at once, no hang
    _wait_until(lambda: _healthy_workers(cluster.url) == {cluster.replicas[0].url}, 30, "the router kept replica 1")
    before = _finished(cluster.replicas[0])
    later = _in_parallel(cluster.url, [f"{w} comes after the kill" for w in ("oscar", "papa", "quebec")])
    assert [r.status_code for r in later] == [200] * len(later)
    assert _finished(cluster.replicas[0]) - before == len(later)


def _timed(url: str, prompt: str) -> tuple[int, float]:
    """(status, when it ended) of a request long enough to be running at the kill."""
    status = _complete(url, prompt, max_tokens=400).status_code
    return status, time.monotonic()
