"""Paged attention for decode: one query token per row against that row's cached context."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.attention_tile import attend_range
from kernels.gemv import num_sms
from kernels.kv_store import check_cache_layout

# Split-K sizing, measured on an H200 at Qwen2.5-1.5B shapes: a program walks its split one tile at a time,
# latency-bound, so short splits (many programs) win at small batch. The grid's split count comes from static
# shapes only (a captured graph must fit every length); each row then cuts its *actual* context into that many
# splits of whole tiles (_split_len), so a short context runs one tile per program instead of a few programs
# walking a long fixed partition. _MAX_PROGRAMS keeps a large batch from launching mostly idle splits,
# _MAX_SPLITS bounds the reduce kernel's tile, and _MIN_PARTITION the splits of a long context (measured best).
_MIN_PARTITION = 256
_MAX_PROGRAMS = 4096
_MAX_SPLITS = 128
_BLOCK_N = 64
_REDUCE_TILE = 8192  # partial elements [heads, splits, head_dim] one reduce program takes: 64 a thread
_NUM_WARPS = 4
_NUM_STAGES = 3


def gather_kv_ref(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """cache[N, Hkv, bs, D] gathered through block_tables[B, :num_blocks] -> [B, Hkv, num_blocks * bs, D]."""
    # Padded table entries may hold any value (e.g. -1); they are masked later, so clamp them to a real block.
    ids = block_tables[:, :num_blocks].long().clamp(min=0)
    blocks = cache[ids]  # [B, n, Hkv, bs, D]
    b, n, h, bs, d = blocks.shape
    return blocks.permute(0, 2, 1, 3, 4).reshape(b, h, n * bs, d)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """Row b attends to its first context_lens[b] cached tokens (float32 math); rows of length 0 give 0."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    # Gather only as many blocks as the longest row needs, not the whole (padded) table width.
    num_blocks = (int(context_lens.max()) + block_size - 1) // block_size if batch else 0
    k = gather_kv_ref(k_cache, block_tables, num_blocks).float()
    v = gather_kv_ref(v_cache, block_tables, num_blocks).float()
    qg = q.float().reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [B, Hkv, G, L]
    pos = torch.arange(k.shape[2], device=q.device)
    valid = pos[None, :] < context_lens[:, None].to(q.device)  # [B, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows -> 0
    return torch.matmul(probs, v).reshape(batch, num_q_heads, head_dim).to(q.dtype)


@triton.jit
def _split_len(ctx, num_splits, BLOCK_N: tl.constexpr):
    # The fewest whole tiles that cover ctx in num_splits splits (never more than the static partition,
    # which covers the longest possible context in as many splits).
    return tl.maximum(tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N), 1) * BLOCK_N


@triton.jit
def _decode_split_kernel(q_ptr, k_cache, v_cache, block_tables, context_lens, part_acc, part_max, part_sum,
                         qk_scale, stride_qb, stride_qh, stride_cb, stride_ch, stride_cs, stride_bt, block_size,
                         group, num_q_heads, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                         GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    # Program (row, kv head, split): the group of query heads sharing this KV head attends to tokens
    # [split * L, (split + 1) * L) of the row (L = _split_len), so each K/V tile is read once for the group.
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    ctx = tl.load(context_lens + b)
    split_len = _split_len(ctx, num_splits, BLOCK_N)
    start = split * split_len
    # A split past the row's length does nothing, not even store: the reduce reads only the used splits.
    # (A graph sized for long contexts launches mostly such programs at short ones.)
    if start < ctx:
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, D_PAD)
        g_mask = offs_g < group
        d_mask = offs_d < HEAD_DIM
        heads = kv_head * group + offs_g
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        block_table_row = block_tables + b.to(tl.int64) * stride_bt
        # The query is the row's last token (position ctx - 1): the mask only cuts the tile's tail past the split.
        m_i, l_i, acc = attend_range(q, tl.full([GROUP_PAD], ctx - 1, tl.int32), m_i, l_i, acc, k_cache, v_cache,
                                     block_table_row, kv_head, start, tl.minimum(start + split_len, ctx),
                                     stride_cb, stride_ch, stride_cs, block_size, offs_d, d_mask, qk_scale, BLOCK_N,
                                     True)
        part = (b * num_q_heads + heads).to(tl.int64) * num_splits + split  # [GROUP_PAD] rows of the partials
        tl.store(part_max + part, m_i, mask=g_mask)
        tl.store(part_sum + part, l_i, mask=g_mask)
        tl.store(part_acc + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_reduce_kernel(out_ptr, context_lens, part_acc, part_max, part_sum, stride_ob, stride_oh,
                          num_q_heads, num_splits, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                          SPLITS_PAD: tl.constexpr, HEADS: tl.constexpr, BLOCK_N: tl.constexpr):
    # Program (row, HEADS query heads): combines each head's used splits by log-sum-exp (base 2, as the
    # partials). Several heads a program where the splits are few: a program per head then had only a few
    # hundred bytes to load, each load waiting on the last (at batch 256, 8% of a decode step).
    b = tl.program_id(0)
    offs_h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    ctx = tl.load(context_lens + b)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    split_len = _split_len(ctx, num_splits, BLOCK_N)
    h_mask = offs_h < num_q_heads
    hs_mask = h_mask[:, None] & (offs_s < (ctx + split_len - 1) // split_len)[None, :]  # [HEADS, SPLITS_PAD]
    d_mask = offs_d < HEAD_DIM
    part = (b * num_q_heads + offs_h[:, None]).to(tl.int64) * num_splits + offs_s[None, :]
    m = tl.load(part_max + part, mask=hs_mask, other=float("-inf"))
    m_all = tl.max(m, axis=1)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # context 0: no split used, avoid -inf - -inf
    weight = tl.where(hs_mask, tl.exp2(m - m_all[:, None]), 0.0)
    total = tl.sum(tl.load(part_sum + part, mask=hs_mask, other=0.0) * weight, axis=1)
    acc = tl.load(part_acc + part[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                  mask=hs_mask[:, :, None] & d_mask[None, None, :], other=0.0)  # [HEADS, SPLITS_PAD, D_PAD]
    out = tl.sum(acc * weight[:, :, None], axis=1) / tl.where(total > 0, total, 1.0)[:, None]  # context 0 -> 0
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


def reduce_heads(batch: int, num_q_heads: int, splits_pad: int, d_pad: int, sms: int) -> int:
    """Query heads a reduce program takes: as many as fit its tile while every SM still gets a program (the
    H200 at batch 1 and 3 splits: 12 heads in one program took 3.2 µs a layer, one head a program 1.9)."""
    per_sm = batch * num_q_heads // sms
    return max(1, min(triton.next_power_of_2(num_q_heads), _REDUCE_TILE // (splits_pad * d_pad),
                      1 << max(0, per_sm.bit_length() - 1)))  # the largest power of two <= per_sm


def _partition_size(batch: int, num_kv_heads: int, max_context: int) -> int:
    """Tokens per split at the longest context, from static shapes only: it sets the grid's split count."""
    splits = max(1, min(_MAX_SPLITS, _MAX_PROGRAMS // max(1, batch * num_kv_heads)))
    return max(_MIN_PARTITION, triton.next_power_of_2(triton.cdiv(max_context, splits)))


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                  partition_size: int | None = None) -> torch.Tensor:
    """Split-K flash decoding; partition_size (a power of two >= 16) overrides the static choice (tests):
    the grid then has cdiv(max_context, partition_size) splits and tiles of min(64, partition_size) keys."""
    check_cache_layout(k_cache, v_cache, q)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    max_context = block_tables.shape[1] * block_size
    partition = partition_size or _partition_size(batch, num_kv_heads, max_context)
    num_splits, block_n = triton.cdiv(max_context, partition), min(_BLOCK_N, partition)
    part_acc = torch.empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    part_max = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    d_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot wants every dim >= 16
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, part_acc, part_max, part_sum, scale * math.log2(math.e),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        block_size, group, num_q_heads, HEAD_DIM=head_dim, D_PAD=d_pad,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES)
    out = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    splits_pad = triton.next_power_of_2(num_splits)
    heads = reduce_heads(batch, num_q_heads, splits_pad, d_pad, num_sms(q.device))
    _decode_reduce_kernel[(batch, triton.cdiv(num_q_heads, heads))](
        out, context_lens, part_acc, part_max, part_sum, out.stride(0), out.stride(1), num_q_heads, num_splits,
        HEAD_DIM=head_dim, D_PAD=d_pad, SPLITS_PAD=splits_pad, HEADS=heads, BLOCK_N=block_n)
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Row b of q[B, Hq, D] attends to its first context_lens[b] cached tokens; length 0 gives zeros."""
    fn = paged_decode_attention_triton if q.is_cuda else paged_decode_attention_ref
    return fn(q, k_cache, v_cache, block_tables, context_lens, scale)
