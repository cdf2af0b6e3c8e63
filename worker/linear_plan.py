"""The linear plan: for each linear shape of a few rows, the Triton GEMV config that runs it, or None for the
unfused path; past GEMV_MAX_M rows, the row count to run cuBLAS on. Shipped for known GPUs (PICKS_PATH), else timed at a shape's first eager call (a shape first met during capture, or untimed in a compile-only run, runs
unfused until then), in a CUDA graph over weights not in L2, and kept on disk under the cache directory, keyed by
the GPU, torch, Triton and the kernels' source."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.runtime.errors import OutOfResources

from kernels.fp8 import Fp8Weight
from kernels.gemv import GEMV_MAX_M, GemvConfig, Weight, candidate_configs, num_sms
from protocol.config import cache_root
from worker.precompile import compile_only, dry_run

GRAPH_CALLS = 32  # timed calls in one CUDA graph
TIMING_REPLAYS = 5  # the median replay counts
MAX_COPIES = 16
MARGIN = 0.97  # a faster path must save 3%: timing noise must not flip a shape
PAD_STEP = 8  # decode graphs hold multiples of 8 rows past 8 (worker/cuda_graphs.py)
PAD_MAX_ROWS = 256  # max_num_seqs' default: the largest decode graph, hence the rows worth timing
FILE_NAME = "kernel-choices-v1.json"
_ROOT = Path(__file__).resolve().parents[1]
# Written by `python -m bench.linear_picks` on each GPU; PICO_VLLM_SHIPPED_PICKS=0 ignores it (every shape is timed).
PICKS_PATH = Path(__file__).with_name("linear_picks.json")
PICKS_FORMAT = 1  # the file's layout: {"format": 1, "gpus": {device name: {pick key: pick}}}
PICKS_ENV = "PICO_VLLM_SHIPPED_PICKS"
_SOURCES = ("worker/linear.py", "worker/linear_plan.py", "kernels/fp8.py", "kernels/gemv*.py")  # under _ROOT

Op = Callable[[Weight, torch.Tensor | None, GemvConfig | None], object]  # (w, bias, config; None: unfused)
Gemm = Callable[[torch.Tensor, Weight, torch.Tensor | None], torch.Tensor]
log = logging.getLogger("pico_vllm.kernels")
_CHOICES: dict[tuple, GemvConfig | None] = {}  # (fold, rows bucket, N, K, dtype, has bias, device, fp8) -> config
_GEMM_TIMES: dict[tuple, dict[int, float]] = {}  # (N, K, dtype, has bias, device, fp8) -> {rows: µs of the GEMM}


def planned_config(fold: str, x: torch.Tensor, w: Weight, bias: torch.Tensor | None, op: Op) -> GemvConfig | None:
    """The config for this fold and shape: from memory, the shipped picks, the disk cache, else timed (and kept);
    None while capturing a shape not looked up yet, or compiling only one not timed yet."""
    key = (fold, triton.next_power_of_2(x.shape[0]), *w.shape, x.dtype, bias is not None, x.device, _scale_block(w))
    if key not in _CHOICES:
        if torch.cuda.is_current_stream_capturing():
            return None
        shape = (
            f"fold {fold!r} rows {key[1]} w {w.shape[0]}x{w.shape[1]} {x.dtype} bias {bias is not None} "
            f"fp8 {_scale_block(w)}"
        )
        kept = _kept("gemv", shape, x.device)  # False: never timed; None: the unfused path won
        if kept is False:
            if (dry := dry_run()) is not None:  # nothing runs: the real run after times it
                dry.deferred += 1
                return None
            kept = fastest_config(fold, x.shape[0], w, bias, op)
            save_choice(f"gemv {_stale_when(x.device)} {shape}", None if kept is None else dataclasses.asdict(kept))
        elif kept is not None:
            kept = GemvConfig(**kept)
        _CHOICES[key] = kept
    return _CHOICES[key]


def fastest_config(fold: str, rows: int, w: Weight, bias: torch.Tensor | None, op: Op) -> GemvConfig | None:
    """Times the unfused path and each candidate config; None unless a candidate is faster by the margin."""
    try:
        copies = cold_copies(w, bias)
        unfused_us = op_us(op, copies, None)
    except torch.OutOfMemoryError:  # the copies did not fit beside the KV cache: cuBLAS, untimed
        log.warning("no memory to time the GEMV candidates for %s: cuBLAS", tuple(w.shape))
        return None
    best, best_us = None, unfused_us * MARGIN
    configs = candidate_configs(*w.shape, num_sms(w.device), rows, fold.endswith("swiglu"), _scale_block(w))
    _compile_candidates(op, *copies[0], configs)
    for config in configs:
        try:
            us = op_us(op, copies, config)
        except OutOfResources:  # a tile too big for this GPU's shared memory: not a candidate here
            continue
        except Exception as e:  # a Triton that cannot build this variant must not stop the engine
            log.warning("GEMV candidate %s (fold %r) failed for %s: %s", config, fold, tuple(w.shape), e)
            continue
        if us < best_us:
            best, best_us = config, us
    return best


def _compile_candidates(op: Op, w: Weight, bias: torch.Tensor | None, configs: list[GemvConfig]) -> None:
    """Every candidate's kernels at once, in parallel; one that cannot build fails again when timed, and is skipped."""
    if w.device.type != "cuda":  # the interpreter compiles nothing (w may be an Fp8Weight)
        return
    with compile_only():
        for config in configs:
            with contextlib.suppress(Exception):
                op(w, bias, config)


def op_us(op: Op, copies: list[tuple[Weight, torch.Tensor | None]], config: GemvConfig | None) -> float:
    """µs a call of op by this config over the weight copies in turn, in a CUDA graph."""
    return graph_us([functools.partial(op, w, bias, config) for w, bias in copies])


def padded_rows(x: torch.Tensor, w: Weight, bias: torch.Tensor | None, gemm: Gemm = F.linear) -> int:
    """The rows to run cuBLAS's gemm(x, w, bias) on: x's own, or more where timed faster (not monotone in rows)."""
    m = x.shape[0]
    if not (x.is_cuda and GEMV_MAX_M < m <= PAD_MAX_ROWS and m % PAD_STEP == 0):
        return m
    times = gemm_times(w, bias, x.dtype, gemm)
    return fastest_rows(times, m) if times else m


def fastest_rows(times: dict[int, float], m: int) -> int:
    """The row count >= m of the least time in `times`, unless it saves under the margin against m's own."""
    best = min((rows for rows in times if rows >= m), key=times.get, default=m)
    return best if m in times and times[best] < MARGIN * times[m] else m


def gemm_times(
    w: Weight, bias: torch.Tensor | None, dtype: torch.dtype, gemm: Gemm = F.linear
) -> dict[int, float] | None:
    """µs of gemm per padded row count for w, shipped or timed once (kept); None if untimed in a capture/dry run."""
    key = (*w.shape, dtype, bias is not None, w.device, _scale_block(w))
    if key not in _GEMM_TIMES:
        if torch.cuda.is_current_stream_capturing():
            return None
        shape = f"w {w.shape[0]}x{w.shape[1]} {dtype} bias {bias is not None} fp8 {_scale_block(w)}"
        kept = _kept("gemm rows", shape, w.device)
        if kept is False:
            if (dry := dry_run()) is not None:  # its timing captures graphs: not beside kernels loading
                dry.deferred += 1
                return None
            kept = _time_rows(w, bias, dtype, gemm)
            save_choice(f"gemm rows {_stale_when(w.device)} {shape}", kept)
        _GEMM_TIMES[key] = {int(rows): us for rows, us in kept.items()}
    return _GEMM_TIMES[key]


def _time_rows(w: Weight, bias: torch.Tensor | None, dtype: torch.dtype, gemm: Gemm) -> dict[str, float]:
    try:
        copies = cold_copies(w, bias)
    except torch.OutOfMemoryError:
        log.warning("no memory to time cuBLAS's row counts for %s: no padding", tuple(w.shape))
        return {}
    times = {}
    for rows in range((GEMV_MAX_M // PAD_STEP + 1) * PAD_STEP, PAD_MAX_ROWS + 1, PAD_STEP):
        x = torch.randn(rows, w.shape[1], dtype=dtype, device=w.device)
        times[str(rows)] = graph_us([functools.partial(gemm, x, c, b) for c, b in copies])
    return times


def graph_us(calls: list[Callable[[], object]]) -> float:
    """µs a call: GRAPH_CALLS calls back to back in a CUDA graph (as a decode step runs them), `calls` in turn."""
    for call in calls:
        call()  # compiles a Triton kernel and settles the allocator outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(GRAPH_CALLS):
            calls[i % len(calls)]()
    graph.replay()
    times = []
    for _ in range(TIMING_REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 1000 * statistics.median(times) / GRAPH_CALLS


def cold_copies(w: Weight, bias: torch.Tensor | None) -> list[tuple[Weight, torch.Tensor | None]]:
    """w (and bias) and enough clones that together they are over twice L2: called in turn, each reads from HBM."""
    l2_bytes = getattr(torch.cuda.get_device_properties(w.device), "L2_cache_size", 64 << 20)
    values = w.weight if isinstance(w, Fp8Weight) else w
    count = min(MAX_COPIES, -(-2 * l2_bytes // (values.numel() * values.element_size())))
    return [(w, bias)] + [(w.clone(), None if bias is None else bias.clone()) for _ in range(count - 1)]


def _scale_block(w: Weight) -> tuple[int, int] | None:
    return w.block if isinstance(w, Fp8Weight) else None


def _kept(kind: str, shape: str, device: torch.device) -> object:
    """This GPU's shipped pick for the shape, else the one timed here before; False when neither has it."""
    shipped = shipped_picks(_gpu(device)).get(f"{kind} {shape}", False)
    return _kept_choices().get(f"{kind} {_stale_when(device)} {shape}", False) if shipped is False else shipped


def read_picks(path: Path) -> dict:
    """The picks file's content; an empty one (no GPU) when it is missing, unreadable or of another format."""
    try:
        data = json.loads(path.read_text())
        if data.get("format") != PICKS_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, this code reads {PICKS_FORMAT}")
    except FileNotFoundError:
        data = {}
    except (OSError, ValueError, AttributeError) as e:
        log.warning("ignoring the shipped linear picks %s (%s): their shapes are timed here", path, e)
        data = {}
    return data or {"format": PICKS_FORMAT, "gpus": {}}


@functools.cache
def shipped_picks(gpu: str) -> dict[str, object]:
    """This GPU's picks by key ("gemv fold ..." a GEMV config or None, "gemm rows w ..." µs by row count)."""
    return {} if os.environ.get(PICKS_ENV, "1") == "0" else read_picks(PICKS_PATH)["gpus"].get(gpu, {})


def _gpu(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _stale_when(device: torch.device) -> str:
    paths = sorted(path for pattern in _SOURCES for path in _ROOT.glob(pattern))
    sources = "".join(source_hash(str(path)) for path in paths)
    return f"{_gpu(device)} torch {torch.__version__} triton {triton.__version__} src {sources}"


@functools.cache
def source_hash(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def load_choices() -> dict[str, object]:
    """Every kept choice by key; empty when the file is missing or unreadable (then each is timed again)."""
    path = cache_root() / FILE_NAME
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("ignoring the kernel choice cache %s (%s): its shapes are timed again", path, e)
        return {}
    return data if isinstance(data, dict) else {}


_kept_choices = functools.lru_cache(maxsize=1)(load_choices)  # read once a process


def save_choice(key: str, value: object) -> None:
    """Add one choice: read, merge, write a temporary sibling, rename (a reader never sees half a file); a racing
    process's new entry may be lost, and is timed again."""
    path, tmp = cache_root() / FILE_NAME, None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {**load_choices(), key: value}
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home must not stop the engine: the choice just is not kept
        log.warning("could not keep a kernel choice in %s: %s", path, e)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
