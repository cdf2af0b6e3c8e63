"""Paged attention of one layer: RoPE + KV-cache store, then decode or varlen-prefill attention."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels import paged_prefill_attention, rope_store_kv
from kernels.decode_attention import NewTokenKV, rope_store_decode_attention


@dataclass
class AttentionMetadata:
    """Where a flat batch of T tokens from B sequences goes in the paged KV cache, and what each attends to."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each token (-1: padded lane, not stored)
    block_tables: torch.Tensor  # [B, M] int32
    context_lens: torch.Tensor  # [B] int32: tokens cached for each sequence after this step
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: sequence b's queries are tokens cu[b]:cu[b+1]
    work: torch.Tensor | None = None  # [2, W] int32 prefill work items; None: a decode step (T == B)
    # A decode step's [B] mirror rows: block_tables is then the runner's whole table, row b's at table_rows[b]
    # (read through in the attention kernel, not gathered before it).
    table_rows: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.table_rows is not None and self.work is not None:
            raise ValueError("AttentionMetadata.table_rows is for decode steps (work None): a prompt step's "
                             "block_tables must be its sequences' own rows")


class Attention(nn.Module):
    """Takes q, k, v views of the fused qkv output; returns [T, Hq * D]."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                cos_sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        if meta.work is None:  # the decode kernel rotates and stores the step's K/V itself
            new_kv = NewTokenKV(k, v, positions, cos_sin, meta.slot_mapping)
            out = rope_store_decode_attention(q, new_kv, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                              self.scale, meta.table_rows)
        else:
            q = rope_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping)
            out = paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                          meta.context_lens, self.scale, meta.work)
        return out.flatten(1)
