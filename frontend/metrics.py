"""Prometheus metrics under vLLM's names, types and buckets (its dashboards work); one registry per server."""
from __future__ import annotations

import time

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
_METRICS = {  # attribute: (type, vLLM's name, help, buckets)
    "running": (Gauge, "vllm:num_requests_running", "Requests in the running batch.", None),
    "waiting": (Gauge, "vllm:num_requests_waiting", "Requests waiting to be scheduled.", None),
    "kv_usage": (Gauge, "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", None),
    "preemptions": (Counter, "vllm:num_preemptions", "Preemptions by the scheduler.", None),
    "prompt_tokens": (Counter, "vllm:prompt_tokens", "Prompt tokens processed.", None),
    "generation_tokens": (Counter, "vllm:generation_tokens", "Tokens generated.", None),
    "ttft": (Histogram, "vllm:time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS),
    "itl": (Histogram, "vllm:inter_token_latency_seconds", "Time between two output tokens.", ITL_BUCKETS),
    "e2e": (Histogram, "vllm:e2e_request_latency_seconds", "Time from arrival to the last token.", E2E_BUCKETS),
}


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        disable_created_metrics()  # as vLLM does: no `*_created` series beside every counter and histogram
        self.registry = CollectorRegistry()
        self.model_name = model_name

        for attr, (kind, name, doc, buckets) in _METRICS.items():  # each labelled once, with this model's name
            extra = {} if buckets is None else {"buckets": buckets}
            setattr(self, attr, kind(name, doc, ["model_name"], registry=self.registry, **extra).labels(model_name))
        self.success = Counter("vllm:request_success", "Requests finished, by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self._preemptions_seen = 0

    def observe_engine(self, stats: dict) -> None:
        """Refresh the engine gauges from the scheduler's stats (cumulative counts become counter steps)."""
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        total = stats["num_total_blocks"]
        self.kv_usage.set(1.0 - stats["num_free_blocks"] / total if total else 0.0)
        new = stats["num_preemptions"] - self._preemptions_seen
        if new > 0:
            self.preemptions.inc(new)
            self._preemptions_seen = stats["num_preemptions"]

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Latency of one engine request: first token, each token after it, and the whole request."""

    def __init__(self, metrics: Metrics, prompt_tokens: int):
        self.metrics, self.prompt_tokens = metrics, prompt_tokens
        self.arrival = self.last = time.perf_counter()
        self.counts: list[int] = []

    def on_tokens(self, counts: list[int]) -> None:
        """Each of the request's n outputs' cumulative token count, after an engine step."""
        new = [count - seen for count, seen in zip(counts, self.counts or [0] * len(counts))]
        if sum(new) <= 0:
            return
        now, m = time.perf_counter(), self.metrics
        if not self.counts:  # the prompt was processed: counted now, so that refused requests never count
            m.prompt_tokens.inc(self.prompt_tokens)
            m.ttft.observe(now - self.arrival)
        else:  # each sample waited the whole gap; one that got several tokens in it spreads the gap over them
            for k in new:
                for _ in range(k):
                    m.itl.observe((now - self.last) / k)
        m.generation_tokens.inc(sum(new))
        self.counts, self.last = list(counts), now

    def finish(self, finish_reasons: list[str]) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)
        for reason in finish_reasons:
            self.metrics.success.labels(self.metrics.model_name, reason).inc()
