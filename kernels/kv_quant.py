"""How the paged KV cache holds K and V: in the model's dtype as they are, or in float8 e4m3 (--kv-cache-dtype fp8)
with one per-tensor scale: stored = (x / scale) clamped to +-448 and rounded to nearest even, read = stored * scale.
The scale is 1.0, vLLM's without calculate_kv_scales or a checkpoint's k_scale / v_scale; per-tensor scales would
replace KV_SCALE here, in the kernels' helpers and the references alike. The kernels choose by the cache pointer's
element type, so a bfloat16 cache compiles to the same code as without this file."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_KV_DTYPE = torch.float8_e4m3fn
KV_SCALE = 1.0
E4M3_MAX = torch.finfo(FP8_KV_DTYPE).max  # 448: e4m3fn has no infinity, larger values would turn NaN
_KV_SCALE = tl.constexpr(KV_SCALE)
_E4M3_MAX = tl.constexpr(E4M3_MAX)


def to_cache_ref(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of cache_dtype stores it (x in float32 or the model's dtype: one rounding either way)."""
    if cache_dtype != FP8_KV_DTYPE:
        return x.to(cache_dtype)
    return (x.float() / KV_SCALE).clamp(-E4M3_MAX, E4M3_MAX).to(cache_dtype)


def from_cache_ref(x: torch.Tensor) -> torch.Tensor:
    """Cached values in float32, as attention reads them."""
    if x.dtype != FP8_KV_DTYPE:
        return x.float()
    return x.float() * KV_SCALE


@triton.jit
def to_cache(x, cache_ptr):
    """x in the element type of cache_ptr, as to_cache_ref rounds it."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        x = tl.clamp(x.to(tl.float32) / _KV_SCALE, -_E4M3_MAX, _E4M3_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def from_cache(x, like):
    """A tile loaded from the cache, in the dtype of its dots with `like` (the query): e4m3 widens exactly to float16
    (a 16-bit query's dots run in float16: on the H200 they are faster than bf16 dots over a widened e4m3 tile)."""
    if x.dtype == tl.float8e4nv:
        x = x.to(tl.float32 if like.dtype == tl.float32 else tl.float16) * _KV_SCALE
    return x
