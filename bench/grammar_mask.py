"""The scheduler's per-token grammar cost on the CPU: compile time, then the bitmask fill and the token accept of
one matcher along a valid answer, with the model's whole vocabulary (Qwen2.5's 151,936 ids by default).

    python -m bench.grammar_mask
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import xgrammar as xgr

from frontend.model_resolution import resolve_model
from frontend.tokenizer import load_tokenizer, tokenizer_dir
from protocol.config import EngineConfig
from scheduler.structured_outputs import StructuredOutputs

SCHEMA = {
    "type": "object",
    "required": ["name", "age", "tags", "address"],
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "required": ["city", "zip"],
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
        },
    },
}
ANSWER = {
    "name": "Alice Smith",
    "age": 31,
    "tags": ["admin", "ops", "on call"],
    "address": {"city": "Paris", "zip": "75001"},
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--rounds", type=int, default=20, help="passes over the answer")
    args = p.parse_args(argv)
    model_config, model_path = resolve_model(args.model, "dummy")
    ids = load_tokenizer(args.model, model_path).encode(json.dumps(ANSWER))  # builds an offline tokenizer's files
    tmp = tempfile.TemporaryDirectory()  # for the shared mask file, as the scheduler's ipc directory holds it
    config = EngineConfig(args.model, model_config=model_config, tokenizer_dir=tokenizer_dir(args.model, model_path))
    grammars = StructuredOutputs(config, os.path.join(tmp.name, "grammar-masks"))
    start = time.perf_counter()
    compiled = grammars.compile({"json": json.dumps(SCHEMA), "any_whitespace": False}).result()
    print(f"first compile (xgrammar and tokenizer load included): {time.perf_counter() - start:.2f} s")
    start = time.perf_counter()
    grammars.compile({"json": json.dumps({**SCHEMA, "title": "x"}), "any_whitespace": False}).result()
    print(f"compile of a new schema: {(time.perf_counter() - start) * 1e3:.1f} ms")
    fill, accept = [], []
    for _ in range(args.rounds):
        matcher = xgr.GrammarMatcher(compiled)
        for token in ids:
            t0 = time.perf_counter()
            grammars.fill(0, [matcher])
            t1 = time.perf_counter()
            assert matcher.accept_token(token)
            fill.append(t1 - t0)
            accept.append(time.perf_counter() - t1)
    for name, times in (("fill (bitmask of one row)", fill), ("accept", accept)):
        us = np.array(times) * 1e6
        print(
            f"{name}: p50 {np.percentile(us, 50):.1f} µs, p90 {np.percentile(us, 90):.1f}, max {us.max():.1f}, "
            f"mean {us.mean():.1f} over {len(us)} tokens"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
