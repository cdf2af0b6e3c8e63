"""Paged attention for decode: one query token per row against that row's cached context."""
from __future__ import annotations

import torch


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


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale)
