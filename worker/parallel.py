"""Tensor-parallel process group: joining it, and the two collectives the model needs. One group: every worker rank is a
TP rank, so torch.distributed's default group is the TP group."""

from __future__ import annotations

import torch
import torch.distributed as dist


def init_tp_group(rank: int, tp_size: int, device: str, init_method: str = "tcp://127.0.0.1:29500") -> None:
    """Join the TP group: NCCL on CUDA, gloo on CPU; the rendezvous is on loopback unless told otherwise."""
    if tp_size == 1:
        return  # nothing to talk to; the layers skip every collective
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=tp_size)


def destroy_tp_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum x over the TP ranks, in place (a no-op at TP 1)."""
    if tp_size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Concatenate every rank's x along the last dim, in rank order."""
    if tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads held (and cached) by each rank: a split when there are enough, else one replicated head."""
    return max(1, num_kv_heads // tp_size)
