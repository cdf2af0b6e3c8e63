"""The combine step of split-K decode attention: the partials (running max, sum, unnormalised output) of a row's
splits merged by log-sum-exp, by the last split to arrive, into the output or into one partial of a tree's level."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def combine_splits(
    parts,
    first,
    step,
    count,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP_P2: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    TO_PARTIAL: tl.constexpr,
):
    # The count partials at slots first, first + step, ... of the KV head's query heads, by log-sum-exp in slot
    # order (a result does not depend on which program came last); normalised into out_ptr, or (TO_PARTIAL) left as
    # a partial in slot first. Loads are .cg: other SMs wrote the partials, and an L1 line here could be stale.
    out_ptr, part_acc, part_max, part_sum, b, kv_head, group, num_q_heads, num_splits, stride_ob, stride_oh = parts
    offs_g, offs_s, offs_d = tl.arange(0, GROUP_P2), tl.arange(0, SPLITS_PAD), tl.arange(0, D_PAD)
    heads = kv_head * group + offs_g
    g_mask, d_mask = offs_g < group, offs_d < HEAD_DIM
    rows = (b * num_q_heads + heads).to(tl.int64) * num_splits + first  # [GROUP_P2]: a head's slot first
    gs_mask = g_mask[:, None] & (offs_s < count)[None, :]
    m = tl.load(
        part_max + rows[:, None] + offs_s[None, :] * step, mask=gs_mask, other=float("-inf"), cache_modifier=".cg"
    )
    m_all = tl.max(m, axis=1)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # padded heads: avoid -inf - -inf
    weight = tl.where(gs_mask, tl.exp2(m - m_all[:, None]), 0.0)
    l = tl.load(part_sum + rows[:, None] + offs_s[None, :] * step, mask=gs_mask, other=0.0, cache_modifier=".cg")
    total = tl.sum(l * weight, axis=1)
    acc = tl.zeros([GROUP_P2, D_PAD], tl.float32)
    for s0 in range(0, count, CHUNK):  # [heads, CHUNK, head_dim] of the accumulators a step
        offs_c = s0 + tl.arange(0, CHUNK)
        gc_mask = g_mask[:, None] & (offs_c < count)[None, :]
        part = rows[:, None] + offs_c[None, :] * step
        w = tl.where(
            gc_mask,
            tl.exp2(tl.load(part_max + part, mask=gc_mask, other=float("-inf"), cache_modifier=".cg") - m_all[:, None]),
            0.0,
        )
        a = tl.load(
            part_acc + part[:, :, None] * HEAD_DIM + offs_d[None, None, :],
            mask=gc_mask[:, :, None] & d_mask[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        acc += tl.sum(a * w[:, :, None], axis=1)
    if TO_PARTIAL:
        # Slot first is read above and overwritten here: every thread finishes its loads first.
        tl.debug_barrier()
        tl.store(part_max + rows, m_all, mask=g_mask)
        tl.store(part_sum + rows, total, mask=g_mask)
        tl.store(part_acc + rows[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])
    else:
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(
            out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )
