"""Prometheus metrics under vLLM's names, types and buckets (its dashboards work); one registry per server.
As in vLLM, each of a request's n samples is a request of its own (its prompt, latencies and finish count n times).
Every series exists at 0 from the start, so that a rate over it reads 0, not "no data"."""

from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

# vLLM's buckets, in seconds (prometheus_client keeps each as a float); TTFT and ITL share 0.5 s to 80 s.
_HALF_SECOND_TO_80 = (0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, *_HALF_SECOND_TO_80, 160, 640, 2560)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, *_HALF_SECOND_TO_80)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920, 7680)
TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))  # vLLM's 1-2-5 series
FINISH_REASONS = ("stop", "length", "abort")
_METRICS = {  # attribute: (type, vLLM's name, help, buckets)
    "running": (Gauge, "vllm:num_requests_running", "Requests in the running batch.", None),
    "waiting": (Gauge, "vllm:num_requests_waiting", "Requests waiting to be scheduled.", None),
    "kv_usage": (Gauge, "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", None),
    "gpu_cache_usage": (Gauge, "vllm:gpu_cache_usage_perc", "kv_cache_usage_perc under its older name.", None),
    "preemptions": (Counter, "vllm:num_preemptions", "Preemptions by the scheduler.", None),
    "prompt_tokens": (Counter, "vllm:prompt_tokens", "Prompt tokens processed.", None),
    "generation_tokens": (Counter, "vllm:generation_tokens", "Tokens generated.", None),
    "ttft": (Histogram, "vllm:time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS),
    "itl": (Histogram, "vllm:inter_token_latency_seconds", "Time between two output tokens.", ITL_BUCKETS),
    "e2e": (Histogram, "vllm:e2e_request_latency_seconds", "Time from arrival to the last token.", E2E_BUCKETS),
    "queue": (Histogram, "vllm:request_queue_time_seconds", "Time waiting before first scheduled.", E2E_BUCKETS),
    "prefill": (
        Histogram,
        "vllm:request_prefill_time_seconds",
        "Time from first scheduled to the first token.",
        E2E_BUCKETS,
    ),
    "decode": (Histogram, "vllm:request_decode_time_seconds", "Time from the first token to the last.", E2E_BUCKETS),
    "request_prompt": (Histogram, "vllm:request_prompt_tokens", "Prompt tokens of a request.", TOKEN_BUCKETS),
    "request_generation": (Histogram, "vllm:request_generation_tokens", "Tokens a request generated.", TOKEN_BUCKETS),
    "cache_queries": (Counter, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", None),
    "cache_hits": (Counter, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", None),
    "spec_drafts": (Counter, "vllm:spec_decode_num_drafts", "Drafts verified (speculative decoding).", None),
    "spec_draft_tokens": (Counter, "vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", None),
    "spec_accepted": (Counter, "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", None),
}
# Counters the scheduler's stats hold as running totals: attribute -> stats key.
_TOTALS = {
    "preemptions": "num_preemptions",
    "spec_drafts": "spec_num_drafts",
    "spec_draft_tokens": "spec_num_draft_tokens",
    "spec_accepted": "spec_num_accepted_tokens",
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
        self.success = Counter(
            "vllm:request_success",
            "Requests finished, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        for reason in FINISH_REASONS:
            self.success.labels(model_name, reason)
        self.spec_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the draft.",
            ["model_name", "position"],
            registry=self.registry,
        )
        self._seen: dict = {}  # the running totals counted so far

    def observe_engine(self, stats: dict) -> None:
        """Refresh the engine gauges from the scheduler's stats (cumulative counts become counter steps)."""
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        total = stats["num_total_blocks"]
        usage = 1.0 - stats["num_free_blocks"] / total if total else 0.0
        self.kv_usage.set(usage)
        self.gpu_cache_usage.set(usage)  # the name older routers and dashboards read
        for attr, key in _TOTALS.items():
            self._count(getattr(self, attr), key, stats.get(key, 0))
        for pos, total in enumerate(stats.get("spec_accepted_per_pos", ())):
            self._count(self.spec_per_pos.labels(self.model_name, str(pos)), pos, total)

    def _count(self, counter: Counter, key: object, total: int) -> None:
        """Step a counter up to the engine's running total under `key`."""
        new = total - self._seen.get(key, 0)
        if new > 0:
            counter.inc(new)
            self._seen[key] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Latency of one request's n samples: first token, each token after it, queue, prefill, decode, the whole."""

    def __init__(self, metrics: Metrics, prompt_tokens: int, n: int = 1):
        self.metrics, self.prompt_tokens = metrics, prompt_tokens
        self.arrival = time.perf_counter()
        self.counts, self.first, self.last = [0] * n, [None] * n, [self.arrival] * n

    def on_tokens(self, counts: list[int]) -> None:
        """Each of the request's n outputs' cumulative token count, after an engine step."""
        now, m = time.perf_counter(), self.metrics
        for i, (count, seen) in enumerate(zip(counts, self.counts)):
            if count <= seen:
                continue
            if not seen:  # its prompt was processed: counted now, so that refused requests never count
                m.prompt_tokens.inc(self.prompt_tokens)
                m.ttft.observe(now - self.arrival)
                self.first[i] = now
            else:  # each sample waited the whole gap; one that got several tokens in it spreads the gap over them
                for _ in range(count - seen):
                    m.itl.observe((now - self.last[i]) / (count - seen))
            m.generation_tokens.inc(count - seen)
            self.counts[i], self.last[i] = count, now

    def finish(self, reasons: list[str], engine_stats: list[dict | None] | None = None) -> None:
        """Each sample's finish reason and TokenBatch.request_stats (None where none came)."""
        m, now = self.metrics, time.perf_counter()
        for i, (reason, stats) in enumerate(zip(reasons, engine_stats or [None] * len(reasons))):
            m.success.labels(m.model_name, reason).inc()
            m.e2e.observe((self.last[i] if self.first[i] is not None else now) - self.arrival)
            m.request_prompt.observe(self.prompt_tokens)
            m.request_generation.observe(self.counts[i])
            if stats is not None and self.first[i] is not None:
                m.queue.observe(stats["queue_time"])
                m.prefill.observe(max(0.0, self.first[i] - self.arrival - stats["queue_time"]))
                m.decode.observe(self.last[i] - self.first[i])
                m.cache_queries.inc(self.prompt_tokens)
                m.cache_hits.inc(stats["num_cached_tokens"])
