"""Launch to first token: importing the frontend, LLM(...) until the engine is ready, one 1-token generate;
and the worker's own parts (weights, kernel compiles, KV profiling, graph capture) and clock marks when its Ready
info reports them. --cold measures a first launch (empty Triton and Pico-vLLM caches in a temporary directory),
then a warm one with the caches it filled, each in a fresh process.

    python -m bench.startup [--cold]
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO_DIR, engine_parser, print_table, random_ids, record, start_engine, timed
from frontend.model_resolution import resolve_model


def main(argv: list[str] | None = None) -> int:
    p = engine_parser(__doc__.splitlines()[0])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument(
        "--cold",
        action="store_true",
        help="a first launch with empty caches in a temporary directory, then a warm one with them",
    )
    args = p.parse_args(argv)
    if args.cold:
        rows = cold_then_warm([a for a in (sys.argv[1:] if argv is None else argv) if a != "--cold"])
        print_table(f"startup: {args.model}, cold then warm", rows)
        record("startup", args, {"rows": rows})
        return 0
    numbers = launch(args)
    print_table(
        f"startup: {args.model}" + ("" if "weights_s" in numbers else " (the engine reports no parts: totals only)"),
        [numbers],
    )
    record("startup", args, numbers)
    return 0


def launch(args) -> dict:
    """One launch's numbers: totals, the worker's parts, and every clock mark as seconds since the launch began."""
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
    # The worker's and the frontend's wall-clock marks on the launch's timeline: where the time outside the
    # worker's own timers goes.
    marks = {f"{name}_at_s": at - start_wall for name, at in sorted(clock.items(), key=lambda item: item[1])}
    return {
        "launch_to_first_token_s": ready - start + first,
        "import_s": imported - start,
        "engine_ready_s": ready - imported,
        "first_token_s": first,
        **marks,
        **parts,
    }


def cold_then_warm(argv: list[str]) -> list[dict]:
    """This bench run twice in fresh processes (argv without --cold), with TRITON_CACHE_DIR and PICO_VLLM_CACHE in
    one new temporary directory: a cold launch, then a warm one; each one's numbers."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="pico-vllm-cold-") as tmp:
        env = {**os.environ, "TRITON_CACHE_DIR": f"{tmp}/triton", "PICO_VLLM_CACHE": f"{tmp}/pico-vllm"}
        for start in ("cold", "warm"):
            out = Path(tmp) / start
            subprocess.run(
                [sys.executable, "-m", "bench.startup", *argv, "--out", str(out)], env=env, cwd=REPO_DIR, check=True
            )
            (path,) = out.glob("*-startup.json")
            rows.append({"start": start, **json.loads(path.read_text())["numbers"]})
    return rows


if __name__ == "__main__":
    sys.exit(main())
