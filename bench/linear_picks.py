"""Times the linear plan's picks on this GPU for every linear of the given models, into worker/linear_picks.json.

The picks are a GEMV config or cuBLAS per fold, rows bucket and weight, and cuBLAS's time at each padded row count,
timed as an engine's start-up times them (TP 1, the models' dtype, dummy weights); they replace what the file held
for this GPU's name, and an engine on this GPU then looks them up instead of timing them. Run it on each GPU to ship
picks for, and again after changing a GEMV kernel; commit the file.

    python -m bench.linear_picks [--models qwen2.5-1.5b qwen3-1.7b ...]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.common import git_commit, print_table, versions
from frontend.model_resolution import resolve_config, short_names
from protocol.config import EngineConfig
from worker import linear_plan as plan

KV_BLOCKS = 1024  # a fixed small cache: no memory profile, and room beside it for the timing's weight copies


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--models", nargs="+", default=short_names(), help="short names, HF directories or repo ids")
    p.add_argument(
        "--quantization",
        nargs="+",
        default=["none", "fp8"],
        choices=["none", "fp8"],
        help="weights to time the picks of: the model's dtype ('none') and FP8",
    )
    p.add_argument("--file", default=str(plan.PICKS_PATH), help="the picks file to merge into")
    args = p.parse_args(argv)
    # Time every shape: neither the shipped file nor this machine's cache may answer for it.
    os.environ[plan.PICKS_ENV] = "0"
    with tempfile.TemporaryDirectory(prefix="pico-vllm-picks-") as cache:
        os.environ["PICO_VLLM_CACHE"] = cache
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("bench.linear_picks times kernels on a GPU: run it on the GPU to ship picks for")
        rows = [time_model(model, q) for model in args.models for q in args.quantization]
        stale = plan._stale_when(torch.device("cuda"))  # a timed pick's disk key is "<kind> <stale> <shape>"
        picks = {key.replace(f" {stale}", "", 1): pick for key, pick in plan.load_choices().items()}
    gpu = torch.cuda.get_device_name()
    merge(Path(args.file), gpu, picks, stale)
    print_table(f"linear picks timed on {gpu}", rows)
    print(f"\nwrote {len(picks)} picks for {gpu!r} into {args.file}")
    return 0


def time_model(model: str, quantization: str) -> dict:
    """Builds the model's runner on the GPU: its compile-only dry run, warm-ups and captures time every linear."""
    import torch

    from worker.startup import build_runner

    started = time.perf_counter()
    config = resolve_config(
        EngineConfig(
            model=model,
            load_format="dummy",
            device="cuda",
            num_kv_blocks=KV_BLOCKS,
            quantization=None if quantization == "none" else quantization,
        )
    )
    runner = build_runner(config)
    row = {
        "model": model,
        "quantization": quantization,
        "seconds": time.perf_counter() - started,
        "kernels_compiled": runner.startup["kernels_compiled"],
    }
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return row


def merge(path: Path, gpu: str, picks: dict[str, object], timed_when: str = "") -> None:
    """This GPU's picks into the file (other GPUs' stay), with what timed them (timed_when: the disk cache's
    staleness key, which names the kernels' source hashes)."""
    data = plan.read_picks(path)
    data["gpus"][gpu] = {**data["gpus"].get(gpu, {}), **picks}
    data.setdefault("timed_with", {})[gpu] = {
        "commit": git_commit(),
        "versions": versions(),
        "key": timed_when,
        "date": datetime.date.today().isoformat(),
    }
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    sys.exit(main())
