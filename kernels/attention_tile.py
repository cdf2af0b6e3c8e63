"""What the paged decode and prefill kernels share: a tile of K/V read through the block table, one online-softmax
step over it, the loop of such steps over a range of the context, and their torch reference. A KV head's cache
travels as one tuple, kv = (k_cache, v_cache, block_table_row, kv_head, stride_cb, stride_ch, stride_cs, block_size,
offs_d, d_mask)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_quant import from_cache, from_cache_ref


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Sequence b's queries q[cu[b]:cu[b+1]] are the last of its context_lens[b] cached tokens, causal, in float32;
    a sequence without context gives zeros."""
    out = torch.zeros_like(q)
    block_size, group = k_cache.shape[2], q.shape[1] // k_cache.shape[1]
    cu = cu_seqlens_q.tolist()
    for b, ctx in enumerate(context_lens.tolist()):
        if cu[b + 1] > cu[b] and ctx > 0:
            blocks = block_tables[b, : -(-ctx // block_size)].long()
            k, v = (
                from_cache_ref(c[blocks].transpose(1, 2).flatten(0, 1)[:ctx]).repeat_interleave(group, 1)
                for c in (k_cache, v_cache)
            )  # [ctx, Hq, D]
            scores = torch.einsum("qhd,khd->hqk", q[cu[b] : cu[b + 1]].float(), k) * scale
            q_pos = torch.arange(ctx - (cu[b + 1] - cu[b]), ctx, device=q.device)
            scores.masked_fill_(torch.arange(ctx, device=q.device)[None, :] > q_pos[:, None], float("-inf"))
            out[cu[b] : cu[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


@triton.jit
def load_kv_tile(kv, offs_n, n_mask):
    """K and V [BLOCK_N, D_PAD] of tokens offs_n of one KV head; masked-off tokens never read their table entry."""
    k_cache, v_cache, block_table_row, kv_head, stride_cb, stride_ch, stride_cs, block_size, offs_d, d_mask = kv
    block_ids = tl.load(block_table_row + offs_n // block_size, mask=n_mask, other=0).to(tl.int64)
    rows = block_ids * stride_cb + (offs_n % block_size) * stride_cs + kv_head * stride_ch
    offsets = rows[:, None] + offs_d[None, :]
    mask = n_mask[:, None] & d_mask[None, :]
    return tl.load(k_cache + offsets, mask=mask, other=0.0), tl.load(v_cache + offsets, mask=mask, other=0.0)


@triton.jit
def _dot(a, b):
    # float32 operands stay float32: by default tl.dot rounds them to TF32, ~1e-3 off float32 Hugging Face.
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def attend_tile(q, k, v, mask, m_i, l_i, acc, qk_scale, APPLY_MASK: tl.constexpr):
    """One online-softmax step of q[M, D] over k, v[N, D] (base-2 running max m_i and sum l_i, unnormalised acc);
    k and v as loaded from the cache (an FP8 cache's are widened here, q rounded to their dtype)."""
    k, v = from_cache(k, q), from_cache(v, q)
    qk = _dot(q.to(k.dtype), tl.trans(k)) * qk_scale  # qk_scale folds in log2(e): exp2 below is the cheap exp
    if APPLY_MASK:
        qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    # A row with nothing visible yet keeps m = -inf; subtracting 0 instead avoids inf - inf = nan.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def attend_range(q, q_pos, m_i, l_i, acc, kv, lo, hi, qk_scale, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Rows of q (at positions q_pos) attend to tokens [lo, hi) of the cache `kv` (load_kv_tile's); CAUSAL masks
    keys past a row's position and hi."""
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        k, v = load_kv_tile(kv, offs_n, n_mask)
        mask = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        m_i, l_i, acc = attend_tile(q, k, v, mask, m_i, l_i, acc, qk_scale, CAUSAL)
    return m_i, l_i, acc
