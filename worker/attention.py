"""The attention backend: a step's attention metadata and launch choices, and one layer's RoPE + KV-cache store +
paged attention. The rest of the worker knows nothing of how the kernels want their inputs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from kernels import paged_prefill_attention, qk_rms_norm, rope_store_kv
from kernels.decode_attention import NewTokenKV, few_rows_launch, rope_store_decode_attention
from kernels.prefill_attention import max_prefill_work, prefill_work

Views = dict[str, torch.Tensor]


@dataclass
class AttentionMetadata:
    """Where a flat batch of T tokens from B sequences goes in the paged KV cache, and what each attends to."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each token (-1: padded lane, not stored)
    block_tables: torch.Tensor  # [B, M] int32
    context_lens: torch.Tensor  # [B] int32: tokens cached for each sequence after this step
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: sequence b's queries are tokens cu[b]:cu[b+1]
    work: torch.Tensor | None = None  # [2, W] int32 prefill work items; None: a decode step (T == B)
    # A decode step's [B] mirror rows: block_tables is then the runner's whole table, row b's at table_rows[b].
    table_rows: torch.Tensor | None = None


class AttentionBackend:
    """Builds a step's AttentionMetadata from its staged views over the runner's device block tables."""

    def __init__(self, block_tables: torch.Tensor, num_kv_heads: int, gqa_group: int, max_batch: int) -> None:
        self.block_tables, self.num_kv_heads, self.gqa_group = block_tables, num_kv_heads, gqa_group
        self._decode_cu = torch.arange(max_batch + 1, dtype=torch.int32, device=block_tables.device)

    def work_items(self, num_tokens: np.ndarray) -> np.ndarray:
        return prefill_work(num_tokens, self.gqa_group)

    def max_work_items(self, tokens: int, seqs: int) -> int:
        return max_prefill_work(tokens, seqs, self.gqa_group)

    def decode_metadata(self, views: Views) -> AttentionMetadata:
        rows = views["rows"]
        # A few rows read their tables through `rows` inside the kernel; many rows gather them once here, which
        # keeps the many-rows kernel's registers low.
        few = few_rows_launch(rows.shape[0], self.num_kv_heads)
        tables = self.block_tables if few else self.block_tables[rows]
        cu = self._decode_cu[: rows.shape[0] + 1]
        return AttentionMetadata(
            views["slot_mapping"], tables, views["context_lens"], cu, table_rows=rows if few else None
        )

    def prefill_metadata(self, views: Views) -> AttentionMetadata:
        return AttentionMetadata(
            views["slot_mapping"],
            self.block_tables[views["rows"]],
            views["context_lens"],
            views["cu_seqlens_q"],
            views["work"],
        )


class Attention(nn.Module):
    """Takes q, k, v views of the fused qkv output (before RoPE); returns [T, Hq * D]."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.scale = head_dim**-0.5

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """qk_norm: (q weight, k weight, eps) of a per-head RMSNorm of q and k before RoPE (Qwen3)."""
        k_cache, v_cache = kv_cache
        if meta.work is None:  # the decode kernel norms, rotates and stores the step's K/V itself
            new_kv = NewTokenKV(k, v, positions, cos_sin, meta.slot_mapping, *(qk_norm or ()))
            out = rope_store_decode_attention(
                q, new_kv, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale, meta.table_rows
            )
        else:
            if qk_norm is not None:
                qk_rms_norm(q, k, *qk_norm)
            q = rope_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping)
            out = paged_prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens, self.scale, meta.work
            )
        return out.flatten(1)
