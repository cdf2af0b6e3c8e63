"""Writing K/V into the paged cache [num_blocks, num_kv_heads, block_size, head_dim], fused with neox-style RoPE
on q and k; slot = block * block_size + offset, and slot -1 (a padded lane) is not written."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.kv_quant import to_cache, to_cache_ref


def make_cos_sin(
    max_pos: int, head_dim: int, theta: float, device: torch.device | str, scaling: dict | None = None
) -> torch.Tensor:
    """cos_sin[max_pos, head_dim] float32: cos in the first half, sin in the second (as Qwen2's HF code);
    scaling: a llama3 rope_scaling (ModelConfig.rope_scaling), or None."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    freqs = torch.outer(torch.arange(max_pos, device=device, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's RoPE scaling, as transformers' _compute_llama3_parameters: wavelengths under the original
    context / high_freq_factor kept, over it / low_freq_factor slowed by `factor`, a smooth ramp between."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low) / (high - low)
    ramp = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    slowed = torch.where(wavelen > old_context / low, inv_freq / factor, ramp)
    return torch.where(wavelen < old_context / high, inv_freq, slowed)


def rope_store_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Returns rotated q (a new tensor); stores rotated k and raw v into the cache; RoPE in float32, rounded once
    to the cache's dtype (kernels/kv_quant.py) as the kernels round it."""
    cos, sin = cos_sin[positions.long()].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D / 2] each

    def rope(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // k_cache.shape[2], slots % k_cache.shape[2]
    k_cache[blocks, :, offsets] = to_cache_ref(rope(k)[keep], k_cache.dtype)
    v_cache[blocks, :, offsets] = to_cache_ref(v[keep], v_cache.dtype)
    return rope(q).to(q.dtype)


@triton.jit
def rope_factors(cos_sin, pos, offs_d, d_mask, HEAD_DIM: tl.constexpr):
    """cos, sin (negated in the first half) and partner index of rotate-half RoPE: out = x * cos + x[partner] * sin."""
    half = HEAD_DIM // 2
    first = offs_d < half
    idx = tl.where(first, offs_d, offs_d - half)
    cos = tl.load(cos_sin + pos * HEAD_DIM + idx, mask=d_mask, other=0.0)
    sin = tl.load(cos_sin + pos * HEAD_DIM + half + idx, mask=d_mask, other=0.0)
    return cos, tl.where(first, -sin, sin), tl.where(first, offs_d + half, offs_d - half)


@triton.jit
def _rotate_store(
    src_ptr,
    dst_ptr,
    src_stride_h,
    dst_stride_h,
    cos,
    sin,
    heads,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    ROPE: tl.constexpr,
):
    """Reads [heads, 2 * HALF] at src, rotates it (if ROPE) and writes it at dst; heads 0 touches nothing."""
    offs_h = tl.arange(0, HEADS_PAD)[:, None]
    offs_d = tl.arange(0, HALF_PAD)[None, :]
    mask = (offs_h < heads) & (offs_d < HALF)
    src = src_ptr + offs_h * src_stride_h + offs_d
    dst = dst_ptr + offs_h * dst_stride_h + offs_d
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    if ROPE:
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        x1, x2 = x1f * cos - x2f * sin, x2f * cos + x1f * sin
    tl.store(dst, to_cache(x1, dst_ptr), mask=mask)
    tl.store(dst + HALF, to_cache(x2, dst_ptr), mask=mask)


@triton.jit
def _kv_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    pos_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ch,
    stride_cs,
    block_size,
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    # One program per token, all its heads: cos/sin and the slot are loaded once; q/k/v are views of the qkv output.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # int64 before the multiply: block * stride_cb overflows int32 on a large cache.
    cache_off = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cos_sin_ptr + pos * 2 * HALF + offs, mask=offs < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * 2 * HALF + HALF + offs, mask=offs < HALF, other=0.0)
    _rotate_store(
        q_ptr + t * stride_qt,
        q_out_ptr + t * stride_ot,
        stride_qh,
        stride_oh,
        cos,
        sin,
        num_q_heads,
        HALF,
        Q_HEADS_PAD,
        HALF_PAD,
        True,
    )
    kv_heads = tl.where(slot >= 0, num_kv_heads, 0)  # slot -1: a padded lane, store nothing
    _rotate_store(
        k_ptr + t * stride_kt,
        k_cache_ptr + cache_off,
        stride_kh,
        stride_ch,
        cos,
        sin,
        kv_heads,
        HALF,
        KV_HEADS_PAD,
        HALF_PAD,
        True,
    )
    _rotate_store(
        v_ptr + t * stride_vt,
        v_cache_ptr + cache_off,
        stride_vh,
        stride_ch,
        cos,
        sin,
        kv_heads,
        HALF,
        KV_HEADS_PAD,
        HALF_PAD,
        False,
    )


def check_cache_layout(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    cos_sin: torch.Tensor | None = None,
) -> None:
    """What the kernels address: the caches and q, and the step's own k, v and cos_sin table where given."""
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(
            f"k_cache/v_cache need equal strides and a contiguous head_dim, got {k_cache.stride()} "
            f"and {v_cache.stride()}; allocate both with torch.empty of one shape"
        )
    if q.stride(-1) != 1:
        raise ValueError(f"q needs a unit stride on head_dim, got strides {q.stride()}; pass q.contiguous()")
    if k is None:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k.shape[-1] % 2:
        raise ValueError(
            f"k/v need a unit stride on an even head_dim, got strides {k.stride()}, {v.stride()} "
            f"and head_dim {k.shape[-1]}"
        )
    if (
        k.shape[-1] != q.shape[-1]
        or cos_sin.dtype != torch.float32
        or not cos_sin.is_contiguous()
        or cos_sin.shape[-1] != q.shape[-1]
    ):
        raise ValueError(
            f"q and k need one head_dim and cos_sin make_cos_sin's contiguous float32 [max_pos, "
            f"{q.shape[-1]}] table, got head_dims {q.shape[-1]}, {k.shape[-1]} and cos_sin "
            f"{cos_sin.dtype} {tuple(cos_sin.shape)}; use make_cos_sin"
        )


def rope_store_kv_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    check_cache_layout(k_cache, v_cache, q, k, v, cos_sin)
    num_tokens, num_kv_heads, head_dim = k.shape
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _kv_store_kernel[(num_tokens,)](
        q,
        k,
        v,
        q_out,
        k_cache,
        v_cache,
        slot_mapping,
        positions,
        cos_sin,
        *q.stride()[:2],
        *k.stride()[:2],
        *v.stride()[:2],
        *q_out.stride()[:2],
        *k_cache.stride()[:3],
        k_cache.shape[2],
        q.shape[1],
        num_kv_heads,
        HALF=head_dim // 2,
        Q_HEADS_PAD=triton.next_power_of_2(q.shape[1]),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
    )
    return q_out


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Returns a new rotated q; stores rotated k and raw v into the paged cache (slot -1 skipped)."""
    fn = rope_store_kv_triton if q.is_cuda else rope_store_kv_ref
    return fn(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
