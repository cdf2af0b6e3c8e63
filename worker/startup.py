"""Start-up of one worker rank: the model and its weights, a compile-only dry run of every kernel, the KV cache
sized by a profiling step, the CUDA graphs' capture, and the line that says what each stage took."""

from __future__ import annotations

import functools
import time

import numpy as np
import torch
from tqdm import tqdm

from protocol.config import EngineConfig
from worker.attention import AttentionMetadata, Views
from worker.cuda_graphs import CudaGraphs, graph_batch_sizes, prefill_buckets
from worker.kv_cache import (
    allocate_kv_cache,
    cpu_num_kv_blocks,
    kv_block_bytes,
    kv_cache_dtype,
    peak_key,
    profile_num_kv_blocks,
)
from worker.loader import init_dummy_weights, load_weights
from worker.model_runner import ModelRunner
from worker.models import model_class
from worker.precompile import DryRun, compile_only

WARMUP_LAYERS = 2  # the first layer (no residual yet) and one like every later one: every kernel variant
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def select_device(device: str, rank: int) -> torch.device:
    """'auto' is CUDA when there is a GPU; the node's rank r (its global rank less the node's first) uses GPU r."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA GPU: use device='cpu' or 'auto'")
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def build_runner(config: EngineConfig, rank: int = 0, tp_size: int = 1, clock: dict | None = None) -> ModelRunner:
    """A ready runner: weights, dry run, KV cache, graphs. clock: wall-clock marks of each stage go in it."""
    if config.model_config is None or config.max_model_len is None:
        raise ValueError(
            f"EngineConfig for {config.model!r} is not resolved: pass it through "
            "frontend.model_resolution.resolve_config first"
        )
    clock = {} if clock is None else clock
    clock["runner_started"] = time.time()
    device = select_device(config.device, rank - config.local_ranks.start)  # GPU r of this node
    dtype = _DTYPES.get(config.dtype)  # 'auto': the checkpoint's on CUDA, float32 on the CPU
    if dtype is None:
        dtype = _DTYPES.get(config.model_config.torch_dtype, torch.bfloat16) if device.type == "cuda" else torch.float32
    cache_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype)
    use_graphs = device.type == "cuda" and not config.enforce_eager
    # On CUDA a prompt step pads to its bucket even eagerly: cuBLAS picks kernels by shape, so eager and graphs agree.
    speculative = config.speculative_config is not None
    buckets = prefill_buckets(config.max_num_batched_tokens, speculative) if device.type == "cuda" else []
    sizes = graph_batch_sizes(config.max_num_seqs) if use_graphs else []
    with torch.inference_mode():
        model = _build_model(config, device, dtype, rank, tp_size)
        clock["weights_loaded"] = time.time()
        max_batch = max(sizes + [config.max_num_seqs])
        runner = ModelRunner(config, model, device, max_batch, max(sizes + [config.max_num_batched_tokens]))
        views = {
            "decode": {s: runner.buffers.decode_views(s) for s in sizes},
            "prefill": {b: runner.buffers.prefill_views(b) for b in buckets},
        }
        dry = _precompile(runner, views, cache_dtype) if use_graphs else DryRun()
        clock["kernels_compiled"] = time.time()
        _init_kv_cache(runner, cache_dtype, rank, clock)
        clock["kv_cache_ready"] = time.time()
        runner.graphs = CudaGraphs(runner.dummy_row, graphs=use_graphs)
        _capture(runner, views, dry.deferred > 0, clock)
    runner.startup = {
        "weights_s": clock["weights_loaded"] - clock["runner_started"],
        "kernels_compiled": len(dry.futures),
        "compile_s": clock["kernels_compiled"] - clock["weights_loaded"],  # the step buffers' allocation too
        "kv_cache_s": clock["kv_cache_ready"] - clock["kernels_compiled"],
        "graph_capture_s": clock["prefill_graphs_captured"] - clock["kv_cache_ready"],
        "prefill_capture_s": clock["prefill_graphs_captured"] - clock["decode_graphs_captured"],
        "graph_warmup_s": runner.graphs.warmup_s,
    }
    return runner


def startup_summary(parts: dict, clock: dict[str, float]) -> str:
    """One line: the seconds to ready, and each stage's."""
    stages = {
        "importing torch": clock["torch_imported"] - clock["worker_entered"],
        "weights": parts["weights_s"],
        f"compiling {parts['kernels_compiled']} Triton kernels": parts["compile_s"],
        "KV cache": parts["kv_cache_s"],
        "CUDA graphs": parts["graph_capture_s"],
    }
    return f"worker ready in {clock['worker_ready'] - clock['worker_entered']:.2f} s: " + ", ".join(
        f"{name} {seconds:.2f} s" for name, seconds in stages.items()
    )


def _build_model(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, rank: int, tp_size: int
) -> torch.nn.Module:
    _check_fp8_support(config, device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the layers create their parameters in the default dtype
    try:
        with torch.device(device):
            model = model_class(config.model_config.architecture)(config.model_config, rank, tp_size)
    finally:
        torch.set_default_dtype(previous)
    if config.load_format == "dummy" or config.model_path is None:
        init_dummy_weights(model, config.seed)
    else:
        load_weights(model, config.model_path, rank, tp_size)
    return model.eval()


def _check_fp8_support(config: EngineConfig, device: torch.device) -> None:
    """FP8 weights and an FP8 KV cache convert in hardware: a GPU of compute capability 8.9 or later (Ada)."""
    needs = []
    if config.model_config.quantization:
        needs.append(("quantization='fp8'", "leave quantization unset and use an unquantized checkpoint"))
    if config.kv_cache_dtype != "auto":
        needs.append((f"kv_cache_dtype={config.kv_cache_dtype!r}", "use kv_cache_dtype='auto'"))
    if not needs or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        setting, fix = needs[0]
        raise ValueError(
            f"{setting} needs a GPU with FP8 (compute capability 8.9 or later, e.g. L4, H100); "
            f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}: {fix} on this GPU"
        )


def _precompile(runner: ModelRunner, views: dict[str, dict[int, Views]], cache_dtype: torch.dtype) -> DryRun:
    """The Triton kernels of the KV profiling and the captures, compiled and loaded in parallel by a dry run of
    each whose launches only compile (Triton's disk cache serves those it holds). Its torch ops run, on the
    captures' shapes: after it, a capture needs no warm-up unless the run deferred a choice that needs timing."""
    runner.kv_caches = _one_block_cache(runner, cache_dtype, WARMUP_LAYERS)  # the real cache's strides and dtype
    with compile_only(progress=True) as dry:
        _profile_forward(runner, cache_dtype, WARMUP_LAYERS)
        for kind, forward in (("decode", runner.decode_forward), ("prefill", runner.prefill_forward)):
            for size_views in views[kind].values():
                forward(size_views, layers=WARMUP_LAYERS)
    return dry


def _init_kv_cache(runner: ModelRunner, cache_dtype: torch.dtype, rank: int, clock: dict) -> None:
    config = runner.config
    block_size = config.block_size
    num_blocks = config.num_kv_blocks
    if num_blocks is None:
        block_bytes = kv_block_bytes(runner.model_config, runner.num_kv_heads, block_size, cache_dtype)
        if runner.device.type == "cpu":
            wanted = -(-config.max_model_len * runner.max_rows // block_size)
            num_blocks = cpu_num_kv_blocks(wanted, block_bytes)
        else:
            peak = functools.partial(_profile_forward, runner, cache_dtype)
            gpu = torch.cuda.get_device_name(runner.device)
            num_blocks = profile_num_kv_blocks(
                config.gpu_memory_utilization, block_bytes, peak, peak_key(config, gpu, rank)
            )
    clock["kv_profiled"] = time.time()
    mc = runner.model_config
    runner.use_kv_cache(allocate_kv_cache(mc, num_blocks, runner.num_kv_heads, block_size, cache_dtype, runner.device))


def _capture(runner: ModelRunner, views: dict[str, dict[int, Views]], warm_up: bool, clock: dict) -> None:
    """Every graph of both kinds, under one progress bar; warm_up: an eager run of a few layers before each."""
    with tqdm(
        total=sum(map(len, views.values())),
        desc="Capturing CUDA graphs",
        unit="graph",
        disable=not runner.graphs.graphs,
    ) as bar:
        for kind, forward in (("decode", runner.decode_forward), ("prefill", runner.prefill_forward)):
            if views[kind]:
                warmup = functools.partial(forward, layers=WARMUP_LAYERS) if warm_up else None
                runner.graphs.capture(kind, views[kind], forward, warmup, bar)
            clock[f"{kind}_graphs_captured"] = time.time()


def _one_block_cache(runner: ModelRunner, cache_dtype: torch.dtype, layers: int) -> list[tuple[torch.Tensor, ...]]:
    shape = (1, runner.num_kv_heads, runner.config.block_size, runner.model_config.head_dim)
    return [(torch.zeros(shape, dtype=cache_dtype, device=runner.device),) * 2 for _ in range(layers)]


def _profile_forward(runner: ModelRunner, cache_dtype: torch.dtype, layers: int | None = None) -> None:
    """A step of max_num_batched_tokens prompt tokens plus full sampling, against a one-block cache; with
    `layers`, a compile-only dry run of those layers and no sampling (its torch ops index by the drawn tokens)."""
    device, tokens = runner.device, runner.config.max_num_batched_tokens
    seq = min(tokens, runner.config.max_model_len)
    cu_host = np.array(list(range(0, tokens, seq)) + [tokens])
    cu = torch.tensor(cu_host, dtype=torch.int32, device=device)
    lens = cu[1:] - cu[:-1]
    positions = torch.arange(tokens, device=device) - cu[:-1].repeat_interleave(lens).long()
    work = torch.from_numpy(runner.attention.work_items(np.diff(cu_host))).to(device)
    blocks = -(-seq // runner.config.block_size)
    meta = AttentionMetadata(
        torch.full((tokens,), -1, dtype=torch.int64, device=device),
        torch.zeros(len(lens), blocks, dtype=torch.int32, device=device),
        lens,
        cu,
        work,
    )
    cache = _one_block_cache(runner, cache_dtype, layers or runner.model_config.num_hidden_layers)
    hidden = runner.model(torch.zeros(tokens, dtype=torch.int64, device=device), positions, meta, cache)
    logits = runner.model.compute_logits(hidden[: min(runner.max_rows, tokens)])
    if layers is None:
        runner.sampler.profile(logits)
