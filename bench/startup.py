"""Launch to first token: importing the frontend, LLM(...) until the engine is ready, one 1-token generate;
and the worker's own parts (weights, KV profiling, graph capture) when its Ready info reports them.

    python -m bench.startup
"""
from __future__ import annotations

import random
import sys
import time

from bench.common import engine_parser, print_table, random_ids, record, start_engine, timed
from frontend.model_resolution import resolve_model


def main(argv: list[str] | None = None) -> int:
    p = engine_parser(__doc__.splitlines()[0])
    p.add_argument("--prompt-len", type=int, default=32)
    args = p.parse_args(argv)
    config, _ = resolve_model(args.model, args.load_format)
    prompt = random_ids(random.Random(args.seed), args.prompt_len, config.vocab_size)

    start, start_wall = time.perf_counter(), time.time()
    from frontend import SamplingParams  # the frontend's imports (transformers) are part of a launch
    imported = time.perf_counter()
    with start_engine(args) as llm:  # defaults, as `launch.py --model M` starts
        ready = time.perf_counter()
        first = timed(llm.generate, prompt, SamplingParams(temperature=0, max_tokens=1), False)
        parts = dict(llm.client.info.get("startup") or {})  # the worker's own timings, when it reports them
        clock = {**parts.pop("clock", {}), **llm.client.clock}
    # The worker's and the frontend's wall-clock marks as seconds since this launch began: where the time
    # outside the worker's own timers goes.
    marks = {f"{name}_at_s": at - start_wall for name, at in sorted(clock.items(), key=lambda item: item[1])}
    numbers = {"launch_to_first_token_s": ready - start + first, "import_s": imported - start,
               "engine_ready_s": ready - imported, "first_token_s": first, **marks, **parts}
    print_table(f"startup: {args.model}" + ("" if parts else " (the engine reports no parts: totals only)"),
                [numbers])
    record("startup", args, numbers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
