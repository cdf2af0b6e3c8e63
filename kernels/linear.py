"""Which path runs a linear of a few rows: the Triton GEMV of kernels/gemv.py, with the ops around the linear
folded in, or the unfused path (those ops' own kernels around cuBLAS or the plain GEMV, as linear() picked),
chosen per shape by timing both.

linear() and norm_linear() pick per (fold, rows bucket, N, K, dtype, bias), where the fold names what the GEMV
takes in: "" (the plain linear), "norm" (the residual add + RMSNorm before it), "swiglu" (SwiGLU after it) or
"norm+swiglu". The first eager call of a shape times the unfused path and a few Triton configs, each in a CUDA
graph over weights not in L2 (as a decode graph runs them), and caches the fastest, so the Triton path is
never the slower one; kernels/tuning_cache.py keeps the picks on disk for the next start. A shape first met
during CUDA-graph capture (no sync possible) runs the unfused path and is chosen at its next eager call; so
does every call off the GPU, in float32 (float16 too for the norm), or of more than GEMV_MAX_M rows.

Past GEMV_MAX_M rows a linear with the norm folded before it may run cuBLAS on more rows than it has
(padded_rows): cuBLAS picks its kernel by shape, and its time is not monotone in the rows (on an H200, Qwen's
gate_up took 38.8 µs at 216 rows and 22.0 at 224). The norm then writes into a buffer of the faster row count,
and the rows past the step's are sliced off the GEMM's output.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import statistics
from collections.abc import Callable

import torch
import triton
from triton.runtime.errors import OutOfResources

from kernels import gemv, tuning_cache
from kernels.gemv import (GEMV_MAX_M, GemvConfig, candidate_configs, gemv_triton, linear_ref, norm_gemv_triton,
                          norm_linear_ref, num_sms, swiglu_linear_ref)

GRAPH_CALLS = 32  # timed calls in one CUDA graph
TIMING_REPLAYS = 5  # the median replay counts
MAX_COPIES = 16  # weight copies for timing: 16 x 6.3 MB (qkv at 1.5B) is about twice an H200's L2

Inputs = tuple  # what a fold takes before (w, bias): (x,), or (x, residual, norm_weight, eps) with "norm"
# The dtypes each Triton path takes. The norm's tensor-core tile holds norm_w * s, not the normed s: float16's
# range (65504) cannot hold that where the residual stream is large, bfloat16's can.
DTYPES = {"": (torch.float16, torch.bfloat16), "norm": (torch.bfloat16,), "swiglu": (torch.float16, torch.bfloat16),
          "norm+swiglu": (torch.bfloat16,)}

log = logging.getLogger("pico_vllm.kernels")


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
    """x[M, K] @ w[N, K]^T + bias (then silu(gate) * up of w = [gate | up] with swiglu): the Triton GEMV for
    few rows on CUDA where it was timed faster, else torch."""
    fold = "swiglu" if swiglu else ""
    return run_path(fold, (x,), w, bias, choice(fold, (x,), w, bias))


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                w: torch.Tensor, bias: torch.Tensor | None = None,
                swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(s, norm_weight, eps), w, bias, swiglu), s) for s = x + residual (s = x when residual is
    None), in one GEMV where that was timed faster than add_rms_norm, then linear()."""
    fold, inputs = ("norm+swiglu" if swiglu else "norm"), (x, residual, norm_weight, eps)
    return run_path(fold, inputs, w, bias, choice(fold, inputs, w, bias))


def _padded_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        w: torch.Tensor, bias: torch.Tensor | None,
                        linear: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_linear_ref(x, residual, norm_weight, eps, w, bias, linear, padded_rows(x, w, bias))


# fold -> (unfused path, fused Triton GEMV): both take (*inputs, w, bias), the Triton one a config after.
# An unfused path runs the folded ops' own kernels around linear(): cuBLAS or the GEMV, whichever was faster,
# so "norm+swiglu" unfused is the norm, then linear(..., swiglu=True)'s own pick (on padded rows past
# GEMV_MAX_M where cuBLAS was timed faster so).
PATHS = {"": (linear_ref, gemv_triton),
         "norm": (functools.partial(_padded_norm_linear, linear=linear), norm_gemv_triton),
         "swiglu": (functools.partial(swiglu_linear_ref, linear=linear), functools.partial(gemv_triton, swiglu=True)),
         "norm+swiglu": (functools.partial(_padded_norm_linear, linear=functools.partial(linear, swiglu=True)),
                         functools.partial(norm_gemv_triton, swiglu=True))}


def run_path(fold: str, inputs: Inputs, w: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig | None):
    """The op by the Triton GEMV with this config, or by its unfused path for None."""
    unfused, fused = PATHS[fold]
    return unfused(*inputs, w, bias) if config is None else fused(*inputs, w, bias, config)


def choice(fold: str, inputs: Inputs, w: torch.Tensor, bias: torch.Tensor | None) -> GemvConfig | None:
    """The Triton config this call runs, or None for the unfused path (off CUDA, too many rows, a dtype the
    Triton path does not take, mixed dtypes)."""
    x = inputs[0]
    if not (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_M and x.dtype in DTYPES[fold]):
        return None  # first, and cheap: a prefill step asks ~200 times (probe17)
    if all(t.dtype == x.dtype for t in (*inputs, w, bias) if isinstance(t, torch.Tensor)):
        return cached_choice(fold, inputs, w, bias)
    return None



# (fold, rows bucket, N, K, dtype, has bias, device) -> the config that beat the unfused path, or None.
# norm_linear's first layer (no residual) shares its key with the others: one more load and store of a
# [rows, K] vector, noise beside the weight.
_CHOICES: dict[tuple, GemvConfig | None] = {}


def cached_choice(fold: str, inputs: Inputs, w: torch.Tensor, bias: torch.Tensor | None) -> GemvConfig | None:
    """The cached pick for this shape, from memory, then the disk cache, else timed (and kept on disk); the
    unfused path (None) while capturing."""
    x = inputs[0]
    key = (fold, triton.next_power_of_2(x.shape[0]), *w.shape, x.dtype, bias is not None, x.device)
    if key not in _CHOICES:
        if torch.cuda.is_current_stream_capturing():
            return None  # timing needs a sync, which capture forbids: unfused now, timed at the next eager call
        disk_key = _disk_key(key)
        kept = _kept_choices().get(disk_key, False)  # False: never timed here; None: the unfused path won
        if kept is False:
            kept = fastest_config(fold, inputs, w, bias)
            tuning_cache.save_choice(disk_key, None if kept is None else dataclasses.asdict(kept))
        elif kept is not None:
            kept = GemvConfig(**kept)
        _CHOICES[key] = kept
    return _CHOICES[key]


PAD_STEP = 8  # decode graphs hold multiples of 8 rows past 8 (worker/cuda_graphs.py)
PAD_MAX_ROWS = 256  # max_num_seqs' default: the largest decode graph, hence the rows worth timing
PAD_MARGIN = 0.97  # as for the GEMVs: timing noise must not pad a step for nothing

# (N, K, dtype, has bias, device) -> {rows: µs of torch's linear}, every multiple of PAD_STEP in
# (GEMV_MAX_M, PAD_MAX_ROWS]; empty where the timing could not run.
_GEMM_TIMES: dict[tuple, dict[int, float]] = {}


def padded_rows(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> int:
    """The rows to run x @ w^T (+ bias) on with cuBLAS: x's own, or more where that was timed faster."""
    m = x.shape[0]
    if not (x.is_cuda and GEMV_MAX_M < m <= PAD_MAX_ROWS and m % PAD_STEP == 0):
        return m  # first, and cheap: a prefill step asks ~60 times
    times = gemm_times(w, bias, x.dtype)
    return fastest_rows(times, m) if times else m


def fastest_rows(times: dict[int, float], m: int) -> int:
    """The row count >= m of the least time in `times`, unless it saves under PAD_MARGIN against m's own."""
    best = min((rows for rows in times if rows >= m), key=times.get, default=m)
    return best if m in times and times[best] < PAD_MARGIN * times[m] else m


def gemm_times(w: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> dict[int, float] | None:
    """µs of torch's linear at each padded row count for this weight, timed once (then kept on disk); None while
    capturing a graph with nothing timed (no padding then: a sync is not allowed)."""
    key = (*w.shape, dtype, bias is not None, w.device)
    if key not in _GEMM_TIMES:
        if torch.cuda.is_current_stream_capturing():
            return None
        n, k, _, has_bias, device = key
        disk_key = f"gemm rows {_stale_when(device)} w {n}x{k} {dtype} bias {has_bias}"
        kept = _kept_choices().get(disk_key)
        if kept is None:
            kept = _time_rows(w, bias, dtype)
            tuning_cache.save_choice(disk_key, kept)
        _GEMM_TIMES[key] = {int(rows): us for rows, us in kept.items()}
    return _GEMM_TIMES[key]


def _time_rows(w: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> dict[str, float]:
    try:
        copies = cold_copies(w, bias)
    except torch.OutOfMemoryError:
        log.warning("no memory to time cuBLAS's row counts for %s: no padding", tuple(w.shape))
        return {}
    times = {}
    for rows in range((GEMV_MAX_M // PAD_STEP + 1) * PAD_STEP, PAD_MAX_ROWS + 1, PAD_STEP):
        x = torch.randn(rows, w.shape[1], dtype=dtype, device=w.device)
        times[str(rows)] = graph_us([functools.partial(linear_ref, x, c, b) for c, b in copies])
    return times


@functools.lru_cache(maxsize=1)
def _kept_choices() -> dict[str, object]:
    return tuning_cache.load_choices()  # read once a process: later saves go to the file, _CHOICES keeps them


def _disk_key(key: tuple) -> str:
    """The in-memory key plus what makes a timing stale: the GPU, torch, Triton and the GEMV sources."""
    fold, rows, n, k, dtype, has_bias, device = key
    return f"gemv {_stale_when(device)} fold {fold!r} rows {rows} w {n}x{k} {dtype} bias {has_bias}"


def _stale_when(device: torch.device) -> str:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    sources = "".join(tuning_cache.source_hash(path) for path in (__file__, gemv.__file__))
    return f"{gpu} torch {torch.__version__} triton {triton.__version__} src {sources}"


def fastest_config(fold: str, inputs: Inputs, w: torch.Tensor, bias: torch.Tensor | None) -> GemvConfig | None:
    """Times the unfused path and each candidate as a decode graph runs them; None unless a candidate is faster."""
    try:
        copies = cold_copies(w, bias)
        unfused_us = path_us(fold, inputs, copies, None)
    except torch.OutOfMemoryError:  # the copies did not fit beside the KV cache: cuBLAS, untimed
        log.warning("no memory to time the GEMV candidates for %s: cuBLAS", tuple(w.shape))
        return None
    best, best_us = None, unfused_us * 0.97  # a 3% margin: timing noise must not flip a shape to Triton
    swiglu = fold.endswith("swiglu")
    for config in candidate_configs(w.shape[0], w.shape[1], num_sms(w.device), inputs[0].shape[0], swiglu):
        try:
            us = path_us(fold, inputs, copies, config)
        except OutOfResources:  # a tile too big for this GPU's shared memory: not a candidate here
            continue
        except Exception as e:  # a Triton that cannot build this variant must not stop the engine: cuBLAS stays
            log.warning("GEMV candidate %s (fold %r) failed for %s: %s", config, fold, tuple(w.shape), e)
            continue
        if us < best_us:
            best, best_us = config, us
    return best


def path_us(fold: str, inputs: Inputs, copies: list[tuple[torch.Tensor, torch.Tensor | None]],
            config: GemvConfig | None) -> float:
    """µs a call of run_path over the weight copies in turn, in a CUDA graph."""
    return graph_us([functools.partial(run_path, fold, inputs, w, bias, config) for w, bias in copies])


def timed_choice(fold: str, inputs: Inputs, w: torch.Tensor,
                 bias: torch.Tensor | None = None) -> tuple[GemvConfig | None, float, float]:
    """(the choice, µs of the unfused path, µs of the chosen one), each over cold weights in a CUDA graph:
    what bench.kernels and the GPU tests report."""
    config = choice(fold, inputs, w, bias)
    copies = cold_copies(w, bias)
    return config, path_us(fold, inputs, copies, None), path_us(fold, inputs, copies, config)


def graph_us(calls: list[Callable[[], object]]) -> float:
    """µs a call: GRAPH_CALLS calls back to back in a CUDA graph, taking `calls` in turn.

    In a graph, as in a decode step, a call costs its kernels and the gaps to the next, not a host launch;
    calls over weight copies larger than L2 together (cold_copies) each read their weights from HBM.
    """
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


def cold_copies(w: torch.Tensor, bias: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """w (and bias) and enough clones that together they are over twice L2 (at most MAX_COPIES)."""
    count = min(MAX_COPIES, -(-2 * _l2_bytes(w.device) // (w.numel() * w.element_size())))
    clones = [(w.clone(), None if bias is None else bias.clone()) for _ in range(count - 1)]
    return [(w, bias), *clones]


def _l2_bytes(device: torch.device) -> int:
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
