"""Writing K/V into the paged cache, optionally fused with neox-style RoPE on q and k.

Cache layout per layer: [num_blocks, num_kv_heads, block_size, head_dim]; slot = block * block_size + offset;
slot -1 marks a padded lane that must not be written.
"""
from __future__ import annotations

import torch


def make_cos_sin(max_pos: int, head_dim: int, theta: float, device: torch.device | str) -> torch.Tensor:
    """cos_sin[max_pos, head_dim] float32: cos in the first half, sin in the second (as Qwen2's HF code)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    freqs = torch.outer(torch.arange(max_pos, device=device, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k_cache/v_cache[slot // bs, :, slot % bs] = k/v[t] for every t whose slot is not -1."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, :, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, :, offsets] = v[keep].to(v_cache.dtype)


def apply_rope_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x[T, H, D] at positions[T], computed in float32."""
    half = x.shape[-1] // 2
    cs = cos_sin[positions.long()].unsqueeze(1)  # [T, 1, D]
    cos, sin = cs[..., :half], cs[..., half:]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope_store_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> torch.Tensor:
    """Returns rotated q (a new tensor); stores rotated k and raw v into the cache."""
    store_kv_ref(apply_rope_ref(k, positions, cos_sin), v, k_cache, v_cache, slot_mapping)
    return apply_rope_ref(q, positions, cos_sin)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> torch.Tensor:
    return rope_store_kv_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
