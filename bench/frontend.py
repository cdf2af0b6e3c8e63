"""The frontend's host cost per output token: OutputProcessor (detokenize, stop strings, outputs) over
TokenBatches of --rows random tokens, with the model's tokenizer, for each detokenizer. CPU only: this is
the work the LLM / server process does for every token the engine sends.

    python -m bench.frontend --model qwen2.5-1.5b
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from unittest import mock

import numpy as np

from bench.common import RESULTS_DIR, print_table, random_ids, record
from frontend import output_processor
from frontend.detokenizer import IncrementalDetokenizer, make_detokenizer
from frontend.model_resolution import resolve_model
from frontend.output_processor import OutputProcessor
from frontend.tokenizer import load_tokenizer
from protocol.messages import TokenBatch
from protocol.sampling import SamplingParams


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="qwen2.5-1.5b", help="short name or Hugging Face directory")
    p.add_argument("--rows", type=int, default=256, help="requests, each getting one token a step")
    p.add_argument("--steps", type=int, default=200, help="TokenBatches processed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS_DIR), help="folder the result JSON is written to")
    return p.parse_args(argv)


def us_per_token(tokenizer, args: argparse.Namespace) -> float:
    """Microseconds of OutputProcessor.process per token, over --steps batches of --rows tokens."""
    rng = random.Random(args.seed)
    vocab = len(tokenizer)
    processor, ids = OutputProcessor(tokenizer), []
    for i in range(args.rows):
        _, msgs = processor.register(
            f"r{i}", None, random_ids(rng, 100, vocab), SamplingParams(max_tokens=args.steps + 1, ignore_eos=True)
        )
        ids.append(msgs[0].request_id)
    batches = [
        TokenBatch(step, ids, np.array(random_ids(rng, args.rows, vocab), np.int32)) for step in range(args.steps)
    ]
    start = time.perf_counter()
    for batch in batches:
        processor.process(batch)
    return (time.perf_counter() - start) / (args.steps * args.rows) * 1e6


def cpu_name() -> str:
    """The host CPU's model (this benchmark measures host time, so the CPU is what it depends on)."""
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _, model_dir = resolve_model(args.model, "dummy")
    tokenizer = load_tokenizer(args.model, model_dir)
    with mock.patch.object(output_processor, "make_detokenizer", IncrementalDetokenizer):  # the baseline
        before = us_per_token(tokenizer, args)
    chosen = type(make_detokenizer(tokenizer, [])).__name__
    rows = [
        {"detokenizer": "IncrementalDetokenizer (windowed decode)", "us_per_token": before},
        {"detokenizer": f"make_detokenizer -> {chosen}", "us_per_token": us_per_token(tokenizer, args)},
    ]
    print_table(f"frontend: {args.rows} rows x {args.steps} steps, {args.model}'s tokenizer", rows)
    record("frontend", args, {"cpu": cpu_name(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
