"""Where a step's GPU time goes: the kernels of decode steps at each batch size and of one full prefill
chunk, from torch.profiler around an in-process ModelRunner (steps as served: decode replays its graphs).
On the CPU (tests) it lists torch ops by their own CPU time instead.

    python -m bench.profile --batches 1 256 --temperatures 0 0.6

Each batch size gets its own rows: prompts of --context random tokens, prefilled in chunks of
max_num_batched_tokens, then --steps decode steps profiled after --warmup unprofiled ones. A kernel's
microseconds are its total over the profiled steps divided by the step count. On the GPU each decode batch also
gets its critical path: each kernel's share of the step, end(k) - end(k - 1) in launch order, which counts what
the kernel does to the ones beside it (under PDL a kernel starts before the one before it ends, and its
duration is no longer its cost).
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

from bench.common import engine_parser, print_table, random_ids, record
from protocol.config import EngineConfig
from protocol.messages import NewRow, StepPlan, i32
from protocol.sampling import SamplingParams


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = engine_parser(__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 256], help="decode batch sizes to profile")
    p.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=[0.0, 0.6],
        help="one per batch size: 0 is greedy (the sampler inside the graph), > 0 samples",
    )
    p.add_argument("--context", type=int, default=512, help="prompt tokens of every row")
    p.add_argument("--steps", type=int, default=20, help="profiled decode steps per batch size")
    p.add_argument("--warmup", type=int, default=5, help="decode steps before the profiled ones")
    p.add_argument("--top", type=int, default=15, help="kernels listed per profile (the rest are summed)")
    args = p.parse_args(argv)
    if len(args.temperatures) != len(args.batches):
        p.error(f"--temperatures has {len(args.temperatures)} values for {len(args.batches)} --batches")
    return args


class Driver:
    """Plans for rows whose blocks are all allocated up front: prefill chunks, then decode steps."""

    def __init__(self, runner, block_size: int) -> None:
        self.runner, self.block_size = runner, block_size
        self.step, self.live = 0, []

    def plan(self, rows: list[int], counts: list[int], new_rows: list = (), free: list[int] = ()) -> StepPlan:
        self.step += 1
        return StepPlan(self.step, i32(rows), i32(counts), list(new_rows), [], i32(list(free)))

    def start_rows(self, prompts: list[list[int]], params: SamplingParams, decode_steps: int, chunk: int) -> None:
        """Drop the previous rows, enter one row per prompt and prefill them all, `chunk` tokens a step."""
        free, self.live = self.live, list(range(len(prompts)))
        new, next_block = [], 0  # the freed rows' blocks are free again: their contents no longer matter
        for row, prompt in enumerate(prompts):
            n = -(-(len(prompt) + decode_steps + 1) // self.block_size)
            blocks = list(range(next_block, next_block + n))
            next_block += n
            new.append(NewRow(row, i32(prompt), len(prompt), 0, i32(blocks), params.row_sampling()))
        pending = [[row, len(p)] for row, p in enumerate(prompts)]
        while pending:
            rows, counts, budget = [], [], chunk
            while pending and budget > 0:
                take = min(pending[0][1], budget)
                rows.append(pending[0][0])
                counts.append(take)
                budget -= take
                pending[0][1] -= take
                if pending[0][1] == 0:
                    pending.pop(0)
            self.runner.execute(self.plan(rows, counts, new, free))
            new, free = [], []

    def decode(self) -> None:
        self.runner.execute(self.plan(self.live, [1] * len(self.live)))


def kernel_table(prof, steps: int, top: int) -> tuple[list[dict], float]:
    """Kernels by time per step, the biggest `top` named and the rest summed; the total µs per step.

    On CUDA the device kernels; on the CPU each op's self time (an op's total would count its children twice).
    """
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        on_device = event.device_type.name == "CUDA"
        if on_device or not prof.use_device:
            entry = per_kernel[event.name]
            entry[0] += event.time_range.elapsed_us() if on_device else event.self_cpu_time_total
            entry[1] += 1
    total = sum(us for us, _ in per_kernel.values()) / steps
    if total <= 0:
        raise RuntimeError("the profiler saw no kernels (are graph replays hidden?): rerun with --enforce-eager")
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])
    rows = [
        {"kernel": name[:80], "calls_per_step": calls / steps, "us_per_step": us / steps, "share": us / steps / total}
        for name, (us, calls) in ranked[:top]
    ]
    rest = sum(us for _, (us, _) in ranked[top:]) / steps
    rows.append({"kernel": f"({max(0, len(ranked) - top)} others)", "us_per_step": rest, "share": rest / total})
    return rows, total


HOST_GAP = "(host: launching the step after its input copy)"


def critical_path(kernels: list[tuple[str, float, float]], steps: int, layers: int) -> list[dict]:
    """The kernels of `steps` identical steps, (name, start µs, end µs) in launch order, by their share of a
    step's critical path: end(k) - end(k - 1), the step's first kernel its duration. A name met c x `layers`
    times a step (c > 1) is told apart by its place in a layer, "name #1" to "name #c". Largest share first.
    The GPU's wait between a host-to-device copy and the next kernel is the host's (this driver's Python and
    the graph's launch, which a served step overlaps): it gets its own row, HOST_GAP, not the kernel's."""
    per_step = len(kernels) // steps
    if per_step == 0 or per_step * steps != len(kernels):
        raise ValueError(
            f"{len(kernels)} kernels are not {steps} steps of the same kernels: profile graph "
            "replays of one batch size only"
        )
    counts: dict[str, int] = defaultdict(int)
    for name, _, _ in kernels[:per_step]:
        counts[name] += 1
    rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])  # share, duration, calls
    for first in range(0, len(kernels), per_step):
        seen: dict[str, int] = defaultdict(int)
        prev_end = kernels[first][1]
        prev_name = ""
        for name, start, end in kernels[first : first + per_step]:
            per_layer = counts[name] // layers if counts[name] % layers == 0 else 1
            label = f"{name} #{seen[name] % per_layer + 1}" if per_layer > 1 else name
            seen[name] += 1
            if prev_name.startswith("Memcpy HtoD") and start > prev_end:
                rows[HOST_GAP][0] += start - prev_end
                rows[HOST_GAP][2] += 1
                prev_end = start
            row = rows[label]
            row[0] += end - prev_end
            row[1] += end - start
            row[2] += 1
            prev_end, prev_name = end, name
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][0])
    return [
        {
            "kernel": label[:80],
            "calls_per_step": calls / steps,
            "share_us_per_step": share / steps,
            "us_per_step": duration / steps,
        }
        for label, (share, duration, calls) in ranked
    ]


def device_kernels(prof) -> list[tuple[str, float, float]]:
    """The profiled device kernels and copies as (name, start µs, end µs), in launch order."""
    return sorted(
        ((e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA"),
        key=lambda k: k[1],
    )


def profiled(fn, steps: int, cuda: bool):
    import torch
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        sync()
    return prof


def decode_table(
    driver: Driver, args: argparse.Namespace, cuda: bool
) -> tuple[list[dict], float, str, list[dict] | str | None]:
    """The kernels of --steps decode steps as served, and on the GPU their critical path (or why there is none);
    run eagerly when the profiler cannot see inside graphs."""

    def tables() -> tuple[list[dict], float, list[dict] | str | None]:
        prof = profiled(driver.decode, args.steps, cuda)
        kernels, total = kernel_table(prof, args.steps, args.top)
        if not cuda:
            return kernels, total, None
        try:
            path = critical_path(device_kernels(prof), args.steps, driver.runner.model_config.num_hidden_layers)
        except ValueError as e:  # steps that differ: the kernel table still stands
            path = str(e)
        return kernels, total, path

    from worker.cuda_graphs import CudaGraphs

    runner = driver.runner
    captured = "decode" in runner.graphs.sizes
    try:
        kernels, total, path = tables()
        return kernels, total, "graphs" if captured else "eager", path
    except RuntimeError:
        if not captured:
            raise
    graphs, runner.graphs = runner.graphs, CudaGraphs(runner.dummy_row, graphs=False)
    try:
        kernels, total, path = tables()
        return kernels, total, "eager: graph replays were invisible to the profiler", path
    finally:
        runner.graphs = graphs


def recapture_seconds(runner) -> float | None:
    """Capturing every decode graph again, with kernels compiled and GEMVs chosen: the capture's own cost,
    which graph_capture_s less this leaves to compiling and timing (None without graphs)."""
    if "decode" not in runner.graphs.sizes:
        return None
    import torch

    start = time.perf_counter()
    with torch.inference_mode():  # the runner's buffers are inference tensors, as at start-up
        runner.graphs.capture("decode", runner.graphs.views["decode"], runner.decode_forward, runner.decode_forward)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from frontend.model_resolution import resolve_config
    from worker.startup import build_runner

    max_len, rows = args.context + args.warmup + args.steps + 1, max(args.batches)
    blocks = args.num_kv_blocks or rows * -(-max_len // 16)  # every row at full length: all the driver needs
    config = EngineConfig(
        args.model,
        device=args.device,
        load_format=args.load_format,
        dtype=args.dtype,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        max_num_seqs=rows,
        max_model_len=max_len,
        block_size=16,
        num_kv_blocks=blocks,
    )
    runner = build_runner(resolve_config(config))
    cuda, vocab = runner.device.type == "cuda", runner.model_config.vocab_size
    driver, rng = Driver(runner, config.block_size), random.Random(args.seed)
    numbers = {"startup": {**runner.startup, "recapture_s": recapture_seconds(runner)}, "decode": []}
    for batch, temperature in zip(args.batches, args.temperatures):
        prompts = [random_ids(rng, args.context, vocab) for _ in range(batch)]
        params = SamplingParams(temperature=temperature, ignore_eos=True)
        driver.start_rows(prompts, params, args.warmup + args.steps, config.max_num_batched_tokens)
        for _ in range(args.warmup):
            driver.decode()
        kernels, total, mode, path = decode_table(driver, args, cuda)
        print_table(
            f"decode ({mode}), batch {batch}, temperature {temperature}: {total:.0f} us of kernels a step", kernels
        )
        if isinstance(path, list):
            print_table(
                f"critical path, batch {batch}: {sum(r['share_us_per_step'] for r in path):.0f} us a step", path
            )
        numbers["decode"].append(
            {
                "batch": batch,
                "temperature": temperature,
                "mode": mode,
                "kernel_us_per_step": total,
                "kernels": kernels,
                "critical_path": path,
            }
        )
    # One step's worth of whole prompts (at least one), as a throughput run's prefill steps are.
    rows = max(1, min(config.max_num_seqs, config.max_num_batched_tokens // args.context))
    prompts = [random_ids(rng, args.context, vocab) for _ in range(rows)]
    tokens = sum(map(len, prompts))
    prof = profiled(lambda: driver.start_rows(prompts, SamplingParams(temperature=0.0), 0, tokens), 1, cuda)
    kernels, total = kernel_table(prof, 1, args.top)
    print_table(f"prefill of {tokens} tokens in one step: {total:.0f} us of kernels", kernels)
    numbers["prefill"] = {"tokens": tokens, "kernel_us": total, "kernels": kernels}
    record("profile", args, numbers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
