"""RequestTimer feeds vLLM's latency histograms; each of a request's n samples counts as a request of its own."""

from __future__ import annotations

import frontend.metrics as metrics_module
from frontend.metrics import Metrics, RequestTimer


def _values(m: Metrics) -> dict[str, float]:
    return {s.name: s.value for metric in m.registry.collect() for s in metric.samples}


def _histogram(m: Metrics, name: str) -> tuple[float, float]:
    """(count, sum) of one histogram of the registry."""
    values = _values(m)
    return values[f"{name}_count"], values[f"{name}_sum"]


def test_inter_token_latency_is_per_sample_for_n_outputs(monkeypatch):
    clock = iter([0.0, 0.5, 1.5, 3.5])  # arrival, first tokens, then steps of 1 s and 2 s
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(clock))
    m = Metrics("m")
    timer = RequestTimer(m, prompt_tokens=7, n=2)
    timer.on_tokens([1, 1])  # both samples' first tokens
    timer.on_tokens([2, 2])  # one token each after 1 s
    timer.on_tokens([3, 5])  # after 2 s: one token, and three tokens that share the gap
    assert _histogram(m, "vllm:time_to_first_token_seconds") == (2, 1.0)  # one first token per sample
    count, total = _histogram(m, "vllm:inter_token_latency_seconds")
    assert count == 6 and abs(total - (1 + 1 + 2 + 3 * 2 / 3)) < 1e-9  # not the gap split across samples
    generated = _values(m)
    assert generated["vllm:generation_tokens_total"] == 8 and generated["vllm:prompt_tokens_total"] == 14


def test_prompt_tokens_count_once_the_prompt_is_processed_and_never_for_a_refused_request():
    m = Metrics("m")
    refused = RequestTimer(m, prompt_tokens=50)
    refused.finish(["abort"])  # the engine refused it: no output ever came
    served = RequestTimer(m, prompt_tokens=7)
    assert _values(m)["vllm:prompt_tokens_total"] == 0
    served.on_tokens([1])
    served.on_tokens([2])
    assert _values(m)["vllm:prompt_tokens_total"] == 7


def test_every_series_exists_at_zero_from_the_start():
    values = _values(Metrics("m"))
    for name in (
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:request_queue_time_seconds_count",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_decode_time_seconds_count",
        "vllm:request_prompt_tokens_count",
        "vllm:request_generation_tokens_count",
    ):
        assert values[name] == 0, name
    reasons = {
        s.labels["finished_reason"]
        for metric in Metrics("m").registry.collect()
        for s in metric.samples
        if s.name == "vllm:request_success_total"
    }
    assert reasons == {"stop", "length", "abort"}


def test_queue_prefill_decode_and_prefix_cache_come_from_the_engines_request_stats(monkeypatch):
    clock = iter([0.0, 1.0, 4.0, 9.0])  # arrival, first tokens, last tokens, finish
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(clock))
    m = Metrics("m")
    timer = RequestTimer(m, prompt_tokens=32, n=2)
    timer.on_tokens([1, 1])
    timer.on_tokens([3, 5])
    timer.finish(
        ["length", "stop"], [{"queue_time": 0.25, "num_cached_tokens": 16}, {"queue_time": 0.5, "num_cached_tokens": 0}]
    )
    assert _histogram(m, "vllm:request_queue_time_seconds") == (2, 0.75)
    assert _histogram(m, "vllm:request_prefill_time_seconds") == (2, 0.75 + 0.5)  # first token - arrival - queue
    assert _histogram(m, "vllm:request_decode_time_seconds") == (2, 6.0)  # last token - first token, each
    assert _histogram(m, "vllm:e2e_request_latency_seconds") == (2, 8.0)
    assert _histogram(m, "vllm:request_prompt_tokens") == (2, 64)
    assert _histogram(m, "vllm:request_generation_tokens") == (2, 8)
    values = _values(m)
    assert values["vllm:prefix_cache_queries_total"] == 64 and values["vllm:prefix_cache_hits_total"] == 16
    success = {
        s.labels["finished_reason"]: s.value
        for metric in m.registry.collect()
        for s in metric.samples
        if s.name == "vllm:request_success_total"
    }
    assert success == {"stop": 1, "length": 1, "abort": 0}


def test_spec_decode_counters_follow_the_schedulers_running_totals():
    m = Metrics("m")
    base = {"num_running": 1, "num_waiting": 0, "num_total_blocks": 8, "num_free_blocks": 8, "num_preemptions": 0}
    for drafts, accepted, per_pos in ((2, 3, [2, 1]), (5, 7, [4, 3])):
        spec = {"spec_num_drafts": drafts, "spec_num_draft_tokens": 2 * drafts, "spec_num_accepted_tokens": accepted}
        m.observe_engine({**base, **spec, "spec_accepted_per_pos": per_pos})
        m.observe_engine({**base, **spec, "spec_accepted_per_pos": per_pos})  # a second look adds nothing
    values = _values(m)
    assert values["vllm:spec_decode_num_drafts_total"] == 5
    assert values["vllm:spec_decode_num_draft_tokens_total"] == 10
    assert values["vllm:spec_decode_num_accepted_tokens_total"] == 7
    per_pos = {
        s.labels["position"]: s.value
        for metric in m.registry.collect()
        for s in metric.samples
        if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    }
    assert per_pos == {"0": 4, "1": 3}
