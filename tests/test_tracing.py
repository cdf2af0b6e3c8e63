"""--trace-dir: one timeline of every process, and a per-stage latency table."""

from __future__ import annotations

import json
import os

from frontend import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5 + i, 6, 7, 8 + i] for i in range(8)]


def test_trace_has_spans_from_every_process_and_a_summary(tiny_ckpt, tmp_path):
    trace_dir = tmp_path / "trace"
    with LLM(str(tiny_ckpt), device="cpu", trace_dir=str(trace_dir)) as llm:
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    trace = json.loads((trace_dir / "trace.json").read_text())
    spans = {(e["cat"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    processes = {cat for cat, _ in spans}
    assert {"frontend", "scheduler", "worker0"} <= processes, processes
    names = {name for _, name in spans}
    for stage in (
        "frontend.tokenize",
        "frontend.send",
        "frontend.receive",
        "frontend.detokenize",
        "scheduler.schedule",
        "scheduler.wait_result",
        "scheduler.on_result",
    ):
        assert stage in names, (stage, sorted(names))
    assert any(name.startswith("worker.") for name in names), sorted(names)
    steps = {e["args"]["step"] for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "worker0"}
    assert len(steps) >= 6  # one prefill step and at least five decode steps, each tagged
    summary = (trace_dir / "summary.txt").read_text()
    for stage in ("frontend.detokenize", "scheduler.schedule"):
        assert stage in summary
    assert "p99" in summary and "gpu idle" in summary


def test_no_trace_file_is_written_when_tracing_is_off(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        llm.generate(PROMPTS[:2], PARAMS, use_tqdm=False)
        assert llm.client.tracer.events == []
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".json")]
