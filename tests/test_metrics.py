"""RequestTimer feeds vLLM's latency histograms: each of a request's n samples waits the whole step gap."""
from __future__ import annotations

import frontend.metrics as metrics_module
from frontend.metrics import Metrics, RequestTimer


def _histogram(m: Metrics, name: str) -> tuple[float, float]:
    """(count, sum) of one histogram of the registry."""
    values = {s.name: s.value for metric in m.registry.collect() for s in metric.samples}
    return values[f"{name}_count"], values[f"{name}_sum"]


def test_inter_token_latency_is_per_sample_for_n_outputs(monkeypatch):
    clock = iter([0.0, 0.5, 1.5, 3.5])  # arrival, first tokens, then steps of 1 s and 2 s
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(clock))
    m = Metrics("m")
    timer = RequestTimer(m, prompt_tokens=7)
    timer.on_tokens([1, 1])  # both samples' first tokens
    timer.on_tokens([2, 2])  # one token each after 1 s
    timer.on_tokens([3, 5])  # after 2 s: one token, and three tokens that share the gap
    assert _histogram(m, "vllm:time_to_first_token_seconds") == (1, 0.5)
    count, total = _histogram(m, "vllm:inter_token_latency_seconds")
    assert count == 6 and abs(total - (1 + 1 + 2 + 3 * 2 / 3)) < 1e-9  # not the gap split across samples
    generated = {s.name: s.value for metric in m.registry.collect() for s in metric.samples}
    assert generated["vllm:generation_tokens_total"] == 8 and generated["vllm:prompt_tokens_total"] == 7


def test_prompt_tokens_count_once_the_prompt_is_processed_and_never_for_a_refused_request():
    m = Metrics("m")
    refused = RequestTimer(m, prompt_tokens=50)
    refused.finish(["abort"])  # the engine refused it: no output ever came
    served = RequestTimer(m, prompt_tokens=7)
    counted = {s.name: s.value for metric in m.registry.collect() for s in metric.samples}
    assert counted.get("vllm:prompt_tokens_total", 0) == 0  # (a labelled counter shows once incremented)
    served.on_tokens([1])
    served.on_tokens([2])
    counted = {s.name: s.value for metric in m.registry.collect() for s in metric.samples}
    assert counted["vllm:prompt_tokens_total"] == 7
