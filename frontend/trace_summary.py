"""At shutdown: every process's trace file joined into trace.json (Perfetto opens it) and summary.txt."""
from __future__ import annotations

import glob
import json
import os

import numpy as np

from protocol.tracing import DECODE_GPU_SPAN


def merge_traces(trace_dir: str) -> tuple[str, str]:
    """Join every process's file into trace.json and write summary.txt; return both paths."""
    events: list[dict] = []
    for path in sorted(glob.glob(os.path.join(trace_dir, "*-*.json"))):
        with open(path) as f:
            events += json.load(f)["traceEvents"]
    trace_path = os.path.join(trace_dir, "trace.json")
    with open(trace_path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ns"}, f)
    summary_path = os.path.join(trace_dir, "summary.txt")
    with open(summary_path, "w") as f:
        f.write(summarize(events))
    return trace_path, summary_path


def summarize(events: list[dict]) -> str:
    """Per process and stage: count and p50/p90/p99 in µs; then the GPU idle time between decode steps."""
    spans: dict[tuple[str, str], list[float]] = {}
    for e in events:
        if e.get("ph") == "X":
            spans.setdefault((e["cat"], e["name"]), []).append(e["dur"])
    lines = [f"{'process':<12} {'stage':<22} {'count':>7} {'p50 us':>10} {'p90 us':>10} {'p99 us':>10}"]
    for (proc, name), durs in sorted(spans.items()):
        p50, p90, p99 = np.percentile(durs, [50, 90, 99])
        lines.append(f"{proc:<12} {name:<22} {len(durs):>7} {p50:>10.1f} {p90:>10.1f} {p99:>10.1f}")
    decode = sorted((e["args"]["step"], e["ts"], e["ts"] + e["dur"]) for e in events
                    if e.get("ph") == "X" and e["name"] == DECODE_GPU_SPAN)
    # Only back-to-back decode steps count: a prefill step between two of them is work, not idle time.
    pairs = [(a, b) for a, b in zip(decode, decode[1:]) if b[0] == a[0] + 1]
    if not pairs:
        lines.append("gpu idle between decode steps: n/a (no two consecutive GPU-timed decode steps)")
    else:
        gaps = np.array([max(0.0, b[1] - a[2]) for a, b in pairs])
        share = 100.0 * gaps.sum() / (gaps.sum() + sum(b[2] - b[1] for _, b in pairs))
        p50, p99 = np.percentile(gaps, [50, 99])
        lines.append(f"gpu idle between decode steps: {share:.2f}% of decode time, gap p50 {p50:.1f} us, "
                     f"p99 {p99:.1f} us over {len(gaps)} gaps")
    return "\n".join(lines) + "\n"
