"""Paged attention for prefill: a varlen flat batch of new queries, causal over cached context + themselves."""
from __future__ import annotations

import torch

from kernels.decode_attention import gather_kv_ref


def _sequence_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, ctx: int, scale: float) -> torch.Tensor:
    """q[qlen, Hq, D] are the last qlen of ctx tokens stored through block_table[1, M]; float32 math."""
    qlen, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    num_blocks = (ctx + block_size - 1) // block_size
    # [Hkv, 1, ctx, D]: the unit dim broadcasts each KV head over its group of query heads.
    k = gather_kv_ref(k_cache, block_table, num_blocks)[:, :, :ctx].transpose(0, 1).float()
    v = gather_kv_ref(v_cache, block_table, num_blocks)[:, :, :ctx].transpose(0, 1).float()
    group = num_q_heads // num_kv_heads
    qg = q.float().reshape(qlen, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, qlen, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [Hkv, G, qlen, ctx]
    q_pos = torch.arange(ctx - qlen, ctx, device=q.device)
    k_pos = torch.arange(ctx, device=q.device)
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [Hkv, G, qlen, D]
    return out.permute(2, 0, 1, 3).reshape(qlen, num_q_heads, head_dim)


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                context_lens: torch.Tensor, scale: float, max_seqlen_q: int) -> torch.Tensor:
    """Sequence b's queries q[cu[b]:cu[b+1]] sit at the end of its context_lens[b] cached tokens."""
    out = torch.zeros_like(q)
    cu, ctx_lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for b, ctx in enumerate(ctx_lens):
        start, end = cu[b], cu[b + 1]
        if end > start:
            attn = _sequence_attention_ref(q[start:end], k_cache, v_cache, block_tables[b:b + 1], ctx, scale)
            out[start:end] = attn.to(q.dtype)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            context_lens: torch.Tensor, scale: float, max_seqlen_q: int) -> torch.Tensor:
    return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                       scale, max_seqlen_q)
