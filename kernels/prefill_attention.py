"""Paged attention for prefill: a varlen flat batch of new queries, causal over cached context + themselves. One
program per (work item, KV head), a work item being a sequence and one block of its queries (prefill_work): a
step's grid does not depend on its sequences (a CUDA graph pads it with items -1)."""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.attention_tile import attend_range, paged_attention_ref
from kernels.kv_store import check_cache_layout

_BLOCK_M = 128  # the fastest tile and launch tried at head_dim 128 in bf16
_BLOCK_N = 64
_NUM_WARPS = 8
_NUM_STAGES = 2


def queries_per_program(group: int) -> int:
    """Queries one program takes: its tile rows are (query, head) pairs over a group of query heads."""
    if not 1 <= group <= _BLOCK_M:
        raise ValueError(f"paged_prefill_attention supports 1 to {_BLOCK_M} query heads per KV head, got {group}")
    return _BLOCK_M // group


def max_prefill_work(tokens: int, seqs: int, group: int) -> int:
    """The most work items a step of `tokens` queries over `seqs` sequences can list."""
    return -(-tokens // queries_per_program(group)) + seqs


def prefill_work(num_tokens: np.ndarray, group: int) -> np.ndarray:
    """[2, W] int32: sequence and query block of every work item, for sequences of num_tokens[b] queries."""
    blocks = -(-np.asarray(num_tokens, np.int64) // queries_per_program(group))
    seq = np.repeat(np.arange(len(blocks)), blocks)
    first = np.repeat(np.cumsum(blocks) - blocks, blocks)
    return np.stack([seq, np.arange(len(seq)) - first]).astype(np.int32)


# num_items not specialised (on % 16): an eager step never compiles a variant that the start-up's graphs did not.
@triton.jit(do_not_specialize=["num_items"])
def _prefill_kernel(
    q_ptr,
    out_ptr,
    k_cache,
    v_cache,
    block_tables,
    cu_seqlens_q,
    context_lens,
    work,
    num_items,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ch,
    stride_cs,
    stride_bt,
    block_size,
    group,
    queries_per_block,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # The tile's rows are (query, head) pairs of the item's queries x the query heads sharing this KV head: each
    # K/V tile is read once for the group, and no row is lost to padding the group to a power of two.
    item, kv_head = tl.program_id(0), tl.program_id(1)
    b = tl.load(work + item)
    if b < 0:  # an item past the step's own (a graph's padding)
        return
    q_block = tl.load(work + num_items + item)
    q_start = tl.load(cu_seqlens_q + b)
    q_len = tl.load(cu_seqlens_q + b + 1) - q_start
    ctx = tl.load(context_lens + b)
    rows = tl.arange(0, BLOCK_M)
    q_first = q_block * queries_per_block
    q_idx = q_first + rows // group
    heads = kv_head * group + rows % group
    offs_d = tl.arange(0, D_PAD)
    row_mask = (q_idx < q_len) & (rows < queries_per_block * group)
    d_mask = offs_d < HEAD_DIM
    tokens = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_pos = ctx - q_len + q_idx  # queries are the last q_len tokens of the context
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # Causal: keys before the block's first position are seen by every row (no mask); keys up to its last
    # real query's position need the mask. A block past q_len does nothing.
    kv_end = tl.where(q_first < q_len, tl.minimum(ctx, ctx - q_len + q_first + queries_per_block), 0)
    full_end = tl.maximum(tl.minimum(((ctx - q_len + q_first + 1) // BLOCK_N) * BLOCK_N, kv_end), 0)
    block_table_row = block_tables + b.to(tl.int64) * stride_bt
    kv = (k_cache, v_cache, block_table_row, kv_head, stride_cb, stride_ch, stride_cs, block_size, offs_d, d_mask)
    m_i, l_i, acc = attend_range(q, q_pos, m_i, l_i, acc, kv, 0, full_end, qk_scale, BLOCK_N, False)
    m_i, l_i, acc = attend_range(q, q_pos, m_i, l_i, acc, kv, full_end, kv_end, qk_scale, BLOCK_N, True)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    work: torch.Tensor,
) -> torch.Tensor:
    """work: prefill_work's [2, W] int32 items on q's device; items whose sequence is -1 are skipped."""
    check_cache_layout(k_cache, v_cache, q)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if work.dim() != 2 or work.shape[0] != 2 or work.dtype != torch.int32 or not work.is_contiguous():
        raise ValueError(
            f"work must be prefill_work's contiguous [2, W] int32 items, got {work.dtype} {tuple(work.shape)}"
        )
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    _prefill_kernel[(work.shape[1], num_kv_heads)](
        q,
        out,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        work,
        work.shape[1],
        scale * math.log2(math.e),
        *q.stride()[:2],
        *out.stride()[:2],
        *k_cache.stride()[:3],
        block_tables.stride(0),
        block_size,
        group,
        queries_per_program(group),
        HEAD_DIM=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N,
        num_warps=_NUM_WARPS,
        num_stages=_NUM_STAGES,
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    work: torch.Tensor,
) -> torch.Tensor:
    """Sequence b's queries q[cu[b]:cu[b+1]] are the last of its context_lens[b] cached tokens, causal."""
    if q.is_cuda:
        return paged_prefill_attention_triton(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, work
        )
    return paged_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)
