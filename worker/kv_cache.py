"""The paged KV cache of one worker rank: how many blocks fit, and the tensors that hold them."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import torch

from kernels.kv_quant import FP8_KV_DTYPE
from protocol.config import EngineConfig, ModelConfig
from worker.linear_plan import load_choices, save_choice, source_hash

ROOT = Path(__file__).resolve().parents[1]

_CPU_KV_CACHE_CAP = 1 << 30  # bytes: a CPU run sizes its cache to the workload, up to this


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for EngineConfig.kv_cache_dtype: the model's ('auto'), or e4m3 ('fp8', 'fp8_e4m3')."""
    return model_dtype if name == "auto" else FP8_KV_DTYPE


def kv_block_bytes(mc: ModelConfig, kv_heads: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block: K and V of block_size tokens, every layer, this rank's KV heads."""
    return 2 * mc.num_hidden_layers * kv_heads * block_size * mc.head_dim * dtype.itemsize


def cpu_num_kv_blocks(wanted: int, block_bytes: int) -> int:
    """A CPU run's blocks: what the workload can use (wanted), up to _CPU_KV_CACHE_CAP, at least two."""
    return max(2, min(wanted, _CPU_KV_CACHE_CAP // block_bytes))


def profile_num_kv_blocks(
    gpu_memory_utilization: float, block_bytes: int, peak_step: Callable[[], None], kept_as: str | None = None
) -> int:
    """Blocks that fit in gpu_memory_utilization of the card after the peak of peak_step (the largest step the
    engine can run, against a cache of one block). kept_as: the key (peak_key) under which the step's transient bytes
    are kept on disk: a later start reads them instead of running the step."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    transient = load_choices().get(kept_as) if kept_as else None
    if not isinstance(transient, int):
        torch.cuda.reset_peak_memory_stats()
        peak_step()
        torch.cuda.synchronize()
        transient = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        torch.cuda.empty_cache()
        if kept_as:
            save_choice(kept_as, transient)
    free, total = torch.cuda.mem_get_info()
    available = total * gpu_memory_utilization - (total - free) - transient
    blocks = int(available // block_bytes)
    if blocks < 2:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} leaves {available / 2**30:.2f} GiB for "
            "the KV cache, under two blocks: raise it, or lower max_num_batched_tokens / max_num_seqs"
        )
    return blocks


def peak_key(config: EngineConfig, gpu: str, rank: int) -> str:
    """The peak step's key: engine config, GPU, rank, torch and our source (it lazy-loads torch kernels: ~0.4 s)."""
    sources = sorted(p for package in ("worker", "kernels") for p in (ROOT / package).rglob("*.py"))
    what = repr((config.to_dict(), gpu, rank, torch.__version__, [source_hash(str(p)) for p in sources]))
    return f"kv peak {hashlib.sha256(what.encode()).hexdigest()[:32]}"


def allocate_kv_cache(
    mc: ModelConfig, num_blocks: int, kv_heads: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) cache, [num_blocks, kv_heads, block_size, head_dim], views of one allocation."""
    # Zeros, not empty: attention multiplies masked-out slots by 0, and 0 * NaN garbage is NaN.
    cache = torch.zeros(
        2, mc.num_hidden_layers, num_blocks, kv_heads, block_size, mc.head_dim, dtype=dtype, device=device
    )
    return [(cache[0, i], cache[1, i]) for i in range(mc.num_hidden_layers)]
