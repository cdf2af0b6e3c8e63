"""Paged attention for decode: one query token per row against that row's cached context."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.arrivals import arrival_counters, last_to_arrive
from kernels.attention_tile import attend_range, attend_tile, load_kv_tile, paged_attention_ref
from kernels.decode_combine import combine_splits
from kernels.kv_quant import to_cache
from kernels.kv_store import check_cache_layout, rope_factors, rope_store_kv_ref
from kernels.norm import qk_rms_norm_ref
from kernels.pdl import pdl_enabled, pdl_launch

# Split-K: the grid's split count comes from static shapes only (a captured graph must fit every length); each row
# cuts its own context into that many splits of whole tiles. Past one level of splits (_SPLIT_GROUP at many rows,
# _FEW_ROWS_ONE_LEVEL at a few) a row combines them as a tree of groups of _SPLIT_GROUP.
_MIN_PARTITION = 64
_MAX_PROGRAMS = 512  # about four programs per SM
_MAX_SPLITS = 128
_SPLIT_GROUP = 8
_BLOCK_N = 64  # tokens a tile holds; an e4m3 cache's tile holds twice as many in the same bytes
_COMBINE_TILE = 64  # partial elements [heads, splits, head_dim] a combine step loads, per thread
# A few rows run a few long programs (8 warps, one wave) with PDL, each loading its first K/V tile before waiting on
# qkv (EARLY) and each next tile before this one's math; many rows follow cuBLAS, which never lets them start early.
_FEW_ROWS_KV_HEADS = 8  # rows x KV heads up to which the few-rows launch applies
_FEW_ROWS_MAX_PROGRAMS = 256
_FEW_ROWS_LAUNCH = dict(num_warps=8, num_stages=3)
_FEW_ROWS_ONE_LEVEL = 32  # a combine level costs its dependent round trips, not its bytes
_MANY_ROWS_LAUNCH = dict(num_warps=4, num_stages=2)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache,
    v_cache,
    block_tables,
    table_rows,
    context_lens,
    out_ptr,
    part_acc,
    part_max,
    part_sum,
    arrivals,
    k_new,
    v_new,
    positions,
    cos_sin,
    slot_mapping,
    q_norm_w,
    k_norm_w,
    norm_eps,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_cb,
    stride_ch,
    stride_cs,
    stride_bt,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    block_size,
    group,
    num_q_heads,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    GROUP_P2: tl.constexpr,
    TOP_PAD: tl.constexpr,
    TOP_CHUNK: tl.constexpr,
    LEAF_PAD: tl.constexpr,
    LEAF_CHUNK: tl.constexpr,
    ONE_LEVEL: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    SPLIT_GROUP: tl.constexpr,
    TABLE_ROWS: tl.constexpr,
    COUNTERS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
    EARLY: tl.constexpr,
    QK_NORM: tl.constexpr,
):
    # Program (row, kv head, split): the query heads sharing this KV head attend to the split's tokens, so each K/V
    # tile is read once for the group. The last of a row's used splits to arrive combines them (no second kernel:
    # at a few rows its launch costs more than its work); past ONE_LEVEL splits, as a tree of groups.
    if PDL and not EARLY:  # o_proj's GEMV may start loading its weights (kernels/pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_splits = tl.num_programs(2)
    parts = (out_ptr, part_acc, part_max, part_sum, b, kv_head, group, num_q_heads, num_splits, stride_ob, stride_oh)
    ctx = tl.load(context_lens + b)
    table_row = tl.load(table_rows + b) if TABLE_ROWS else b
    split_len = tl.maximum(tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N), 1) * BLOCK_N  # the fewest whole tiles
    used = tl.cdiv(ctx, split_len)  # splits that start before ctx: 0 at context 0
    start = split * split_len
    # A split past the row's length does nothing; split 0 runs at context 0 to write zeros.
    if (split < used) | (split == 0):
        offs_g, offs_d = tl.arange(0, GROUP_PAD), tl.arange(0, D_PAD)
        g_mask, d_mask = offs_g < group, offs_d < HEAD_DIM
        heads = kv_head * group + offs_g
        q_rows = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
        block_table_row = block_tables + table_row.to(tl.int64) * stride_bt
        kv = (k_cache, v_cache, block_table_row, kv_head, stride_cb, stride_ch, stride_cs, block_size, offs_d, d_mask)
        end = tl.minimum(start + split_len, ctx)
        # No kernel before this one writes this layer's cache: only the step's own token can be stale in it.
        if EARLY:
            offs_n = start + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            k_first, v_first = load_kv_tile(kv, offs_n, n_mask)
        cos, sin, partner = rope_factors(cos_sin, tl.load(positions + b).to(tl.int64), offs_d, d_mask, HEAD_DIM)
        slot = tl.load(slot_mapping + b).to(tl.int64)
        if PDL:
            tl.extra.cuda.gdc_wait()
            if EARLY:
                # Only now may o_proj start: its weight loads would slow a short attention's own.
                tl.extra.cuda.gdc_launch_dependents()
        q = tl.load(q_rows + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        # The split holding position ctx - 1 stores the step's rotated K and V there, then puts them into its first
        # tile or reads them back in its loop (the barrier makes the stores visible to all its threads).
        q_partner = tl.load(q_rows + partner[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        if QK_NORM:  # Qwen3's per-head RMSNorm before RoPE, here rather than in a kernel of its own
            q, q_partner = _norm_head(q, q_partner, q_norm_w, offs_d, partner, d_mask, norm_eps, HEAD_DIM, 1)
        q = (q.to(tl.float32) * cos[None, :] + q_partner.to(tl.float32) * sin[None, :]).to(q_ptr.dtype.element_ty)
        if (split == used - 1) & (slot >= 0):
            cache_off = (slot // block_size) * stride_cb + kv_head * stride_ch + (slot % block_size) * stride_cs
            k_row = k_new + b.to(tl.int64) * stride_kb + kv_head * stride_kh
            k = tl.load(k_row + offs_d, mask=d_mask, other=0.0)
            k_partner = tl.load(k_row + partner, mask=d_mask, other=0.0)
            if QK_NORM:
                k, k_partner = _norm_head(k, k_partner, k_norm_w, offs_d, partner, d_mask, norm_eps, HEAD_DIM, 0)
            k = to_cache(k.to(tl.float32) * cos + k_partner.to(tl.float32) * sin, k_cache)
            tl.store(k_cache + cache_off + offs_d, k, mask=d_mask)
            v = tl.load(v_new + b.to(tl.int64) * stride_vb + kv_head * stride_vh + offs_d, mask=d_mask, other=0.0)
            v = to_cache(v, v_cache)
            tl.store(v_cache + cache_off + offs_d, v, mask=d_mask)
            tl.debug_barrier()
            if EARLY:
                is_new = (offs_n == ctx - 1)[:, None]
                k_first = tl.where(is_new, k[None, :], k_first)
                v_first = tl.where(is_new, v[None, :], v_first)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        # The query is the row's last token (position ctx - 1): the mask only cuts the tile's tail past the split.
        if EARLY:
            m_i, l_i, acc = _attend_ahead(q, k_first, v_first, n_mask, m_i, l_i, acc, kv, start, end, qk_scale, BLOCK_N)
        else:
            q_pos = tl.full([GROUP_PAD], ctx - 1, tl.int32)
            m_i, l_i, acc = attend_range(q, q_pos, m_i, l_i, acc, kv, start, end, qk_scale, BLOCK_N, True)
        if used <= 1:  # the whole row in this program: no partials, no arrival; context 0 gives 0 / 1
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(
                out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=g_mask[:, None] & d_mask[None, :],
            )
        else:
            part = (b * num_q_heads + heads).to(tl.int64) * num_splits + split  # [GROUP_PAD] rows of the partials
            tl.store(part_max + part, m_i, mask=g_mask)
            tl.store(part_sum + part, l_i, mask=g_mask)
            tl.store(part_acc + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])
            counters = arrivals + (b * tl.num_programs(1) + kv_head) * COUNTERS  # [top, group 0, group 1, ...]
            two_levels = used > ONE_LEVEL
            on_top = used > 1  # one level: every split arrives on the top counter; two: each group's last does
            if two_levels:
                first = split - split % SPLIT_GROUP
                count = tl.minimum(used - first, SPLIT_GROUP)  # the last group may be short
                on_top = last_to_arrive(counters + 1 + split // SPLIT_GROUP, count)
                if on_top:
                    combine_splits(parts, first, 1, count, HEAD_DIM, D_PAD, GROUP_P2, LEAF_PAD, LEAF_CHUNK, True)
            if on_top:
                if EARLY:
                    # A few rows fit the top combine's tile to what it takes (more call sites cost many rows registers).
                    if two_levels:
                        top_count = tl.cdiv(used, SPLIT_GROUP)
                        if last_to_arrive(counters, top_count):
                            combine_splits(
                                parts, 0, SPLIT_GROUP, top_count, HEAD_DIM, D_PAD, GROUP_P2, TOP_PAD, TOP_CHUNK, False
                            )
                    elif last_to_arrive(counters, used):
                        if used <= SPLIT_GROUP:  # a few splits: the smaller tile loads and sums less
                            combine_splits(parts, 0, 1, used, HEAD_DIM, D_PAD, GROUP_P2, LEAF_PAD, LEAF_CHUNK, False)
                        else:
                            combine_splits(parts, 0, 1, used, HEAD_DIM, D_PAD, GROUP_P2, ONE_LEVEL, ONE_CHUNK, False)
                else:
                    step = tl.where(two_levels, SPLIT_GROUP, 1)  # the group partials sit at slots 0, G, 2G, ...
                    top_count = tl.cdiv(used, step)
                    if last_to_arrive(counters, top_count):
                        combine_splits(parts, 0, step, top_count, HEAD_DIM, D_PAD, GROUP_P2, TOP_PAD, TOP_CHUNK, False)


@triton.jit
def _norm_head(x, x_partner, w_ptr, offs_d, partner, d_mask, eps, HEAD_DIM: tl.constexpr, AXIS: tl.constexpr):
    """RMSNorm of a head (rows of x along AXIS 1, or one row) and of its RoPE partner view, rounded as HF does."""
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=AXIS, keep_dims=True) / HEAD_DIM + eps)
    w = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    w_partner = tl.load(w_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)
    if AXIS == 1:
        w, w_partner = w[None, :], w_partner[None, :]
    normed = (xf * rstd).to(x.dtype).to(tl.float32) * w
    normed_partner = (x_partner.to(tl.float32) * rstd).to(x.dtype).to(tl.float32) * w_partner
    return normed.to(x.dtype), normed_partner.to(x.dtype)


@triton.jit
def _attend_ahead(q, k, v, n_mask, m_i, l_i, acc, kv, lo, hi, qk_scale, BLOCK_N: tl.constexpr):
    # Tokens [lo, hi), tile lo's K/V already loaded: each next tile's loads are issued before this tile's math. The
    # last tile skips the look-ahead, whose masked address math is not free (at batch 1 most splits are one tile).
    for n0 in range(lo, hi, BLOCK_N):
        offs_next = n0 + BLOCK_N + tl.arange(0, BLOCK_N)
        next_mask = offs_next < hi
        if n0 + BLOCK_N < hi:
            k_next, v_next = load_kv_tile(kv, offs_next, next_mask)
        else:
            k_next, v_next = k, v
        m_i, l_i, acc = attend_tile(q, k, v, n_mask[None, :], m_i, l_i, acc, qk_scale, True)
        k, v, n_mask = k_next, v_next, next_mask
    return m_i, l_i, acc


def few_rows_launch(batch: int, num_kv_heads: int) -> bool:
    """Whether a decode batch of this size runs the few-rows launch, which reads block tables through table_rows
    (many rows' callers gather the tables once a step instead: a gather here would run every layer)."""
    return batch * num_kv_heads <= _FEW_ROWS_KV_HEADS


def _partition_size(batch: int, num_kv_heads: int, max_context: int) -> int:
    """Tokens per split at the longest context, from static shapes only: it sets the grid's split count."""
    programs = _FEW_ROWS_MAX_PROGRAMS if few_rows_launch(batch, num_kv_heads) else _MAX_PROGRAMS
    splits = max(1, min(_MAX_SPLITS, programs // max(1, batch * num_kv_heads)))
    return max(_MIN_PARTITION, triton.next_power_of_2(triton.cdiv(max_context, splits)))


@dataclass(frozen=True)
class NewTokenKV:
    """A decode step's own K and V [B, Hkv, D], rotated at positions[b] and stored at slot_mapping[b] (-1: not);
    with q_norm and k_norm, q and k are RMS-normed per head first (Qwen3)."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor  # [max_pos, D] float32, make_cos_sin's table
    slot_mapping: torch.Tensor
    q_norm: torch.Tensor | None = None  # [D] weights
    k_norm: torch.Tensor | None = None
    norm_eps: float = 1e-6


def rope_store_decode_attention_triton(
    q: torch.Tensor,
    new_kv: NewTokenKV,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    table_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Split-K flash decoding in one kernel, its splits combined by the last to arrive."""
    check_cache_layout(k_cache, v_cache, q, new_kv.k, new_kv.v, new_kv.cos_sin)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    max_context = block_tables.shape[1] * block_size
    partition = _partition_size(batch, num_kv_heads, max_context)
    tile = _BLOCK_N * 2 if k_cache.element_size() == 1 else _BLOCK_N  # a 64-token e4m3 tile is too short to pay
    num_splits, block_n = triton.cdiv(max_context, partition), min(tile, partition)
    part_acc = torch.empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    part_max = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    out = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    d_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot wants every dim >= 16
    group_p2 = triton.next_power_of_2(group)  # the combine's heads: no tl.dot there, so no padding to 16
    few_rows = few_rows_launch(batch, num_kv_heads)
    launch = _FEW_ROWS_LAUNCH if few_rows else _MANY_ROWS_LAUNCH
    top_pad = max(_SPLIT_GROUP, _MAX_SPLITS // _SPLIT_GROUP)  # the most partials the top of a tree takes
    leaf_pad = _SPLIT_GROUP if few_rows else top_pad  # any other combine's
    # Splits a combine step takes: from static shapes only, so the kernel compiles once per launch shape.
    per_step = _COMBINE_TILE * 32 * launch["num_warps"] // (group_p2 * d_pad)
    one_level = _FEW_ROWS_ONE_LEVEL if few_rows else _SPLIT_GROUP
    top_chunk, leaf_chunk, one_chunk = (max(1, min(pad, per_step)) for pad in (top_pad, leaf_pad, one_level))
    # Counters [rows, kv heads, counters]: a (row, kv head)'s top counter, then one for each group of its splits.
    counters = 1 + _MAX_SPLITS // _SPLIT_GROUP
    rows = context_lens if table_rows is None else table_rows  # a placeholder is never read without TABLE_ROWS
    norm_w = (new_kv.cos_sin, new_kv.cos_sin) if new_kv.q_norm is None else (new_kv.q_norm, new_kv.k_norm)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        rows,
        context_lens,
        out,
        part_acc,
        part_max,
        part_sum,
        arrival_counters(q.device, batch * num_kv_heads * counters, "decode attention"),
        new_kv.k,
        new_kv.v,
        new_kv.positions,
        new_kv.cos_sin,
        new_kv.slot_mapping,
        *norm_w,
        new_kv.norm_eps,
        scale * math.log2(math.e),
        *q.stride()[:2],
        *out.stride()[:2],
        *k_cache.stride()[:3],
        block_tables.stride(0),
        *new_kv.k.stride()[:2],
        *new_kv.v.stride()[:2],
        block_size,
        group,
        num_q_heads,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        GROUP_PAD=max(16, group_p2),
        GROUP_P2=group_p2,
        TOP_PAD=top_pad,
        TOP_CHUNK=top_chunk,
        LEAF_PAD=leaf_pad,
        LEAF_CHUNK=leaf_chunk,
        ONE_LEVEL=one_level,
        ONE_CHUNK=one_chunk,
        SPLIT_GROUP=_SPLIT_GROUP,
        TABLE_ROWS=table_rows is not None,
        COUNTERS=counters,
        BLOCK_N=block_n,
        PDL=pdl_enabled(q.device),
        EARLY=few_rows,
        QK_NORM=new_kv.q_norm is not None,
        **launch,
        **(pdl_launch(q.device) if few_rows else {}),
    )
    return out


def rope_store_decode_attention(
    q: torch.Tensor,
    new_kv: NewTokenKV,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    table_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """rope_store_kv of the step's q[B, Hq, D], k, v, then row b attends to its first context_lens[b] cached tokens
    (0 gives zeros), its block table block_tables[table_rows[b]] given table_rows; one kernel on CUDA."""
    if q.is_cuda:
        return rope_store_decode_attention_triton(
            q, new_kv, k_cache, v_cache, block_tables, context_lens, scale, table_rows
        )
    if new_kv.q_norm is not None:
        qk_rms_norm_ref(q, new_kv.k, new_kv.q_norm, new_kv.k_norm, new_kv.norm_eps)
    q = rope_store_kv_ref(
        q, new_kv.k, new_kv.v, new_kv.positions, new_kv.cos_sin, k_cache, v_cache, new_kv.slot_mapping
    )
    tables = block_tables if table_rows is None else block_tables[table_rows]
    cu_seqlens_q = torch.arange(q.shape[0] + 1, device=q.device)
    return paged_attention_ref(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, scale)
