"""Which path runs a linear: the Triton GEMV with the ops around it folded in ("" none, "norm" for a NormedInput,
"swiglu", "norm+swiglu") where worker/linear_plan.py timed it faster, else those ops' own kernels around the
plain linear's pick (cuBLAS, on padded rows where faster, or the GEMV). FP8 weights (an Fp8Weight) take the same
paths, their unfused one being FP8_GEMM's."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels.fp8 import Fp8Weight, scaled_mm_linear, scaled_mm_supported
from kernels.gemv import (
    GEMV_MAX_M,
    GemvConfig,
    Input,
    NormedInput,
    Weight,
    gemv_triton,
    norm_linear_ref,
    swiglu_linear_ref,
)
from worker import linear_plan

# The dtypes each fold's Triton path takes. The norm's tensor-core tile holds norm_w * s, not the normed s:
# float16's range cannot hold that where the residual stream is large, bfloat16's can.
DTYPES = {
    "": (torch.float16, torch.bfloat16),
    "norm": (torch.bfloat16,),
    "swiglu": (torch.float16, torch.bfloat16),
    "norm+swiglu": (torch.bfloat16,),
}
# FP8 weights past the GEMV's rows: a SCALED_MM path (FP8 tensor cores, x quantized per row, cuBLAS's fast sums or
# not) or "dequant" (a bf16 copy, then cuBLAS); `bench.kernels --fp8` times each (per-tensor x: slower, dropped).
SCALED_MM = {"scaled_mm": {}, "scaled_mm_fast": {"fast_accum": True}}
FP8_GEMM = "scaled_mm"


def linear(x: Input, w: Weight, bias: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
    """x[M, K] @ w[N, K]^T + bias, then silu(gate) * up of w = [gate | up] with swiglu; x may be a NormedInput."""
    fold = ("norm+swiglu" if swiglu else "norm") if isinstance(x, NormedInput) else ("swiglu" if swiglu else "")
    return run_path(fold, x, w, bias, choice(fold, x, w, bias))


def run_path(fold: str, x: Input, w: Weight, bias: torch.Tensor | None, config: GemvConfig | None) -> torch.Tensor:
    """The op by the Triton GEMV with this config, or by its unfused path for None."""
    if config is None:
        return UNFUSED[fold](x, w, bias)
    return gemv_triton(x, w, bias, config, fold.endswith("swiglu"))


def choice(fold: str, x: Input, w: Weight, bias: torch.Tensor | None) -> GemvConfig | None:
    """The Triton config this call runs, or None for the unfused path."""
    tensors = (x.x, x.residual, x.weight, x.residual_out) if isinstance(x, NormedInput) else (x,)
    first = tensors[0]
    if not (first.is_cuda and first.dim() == 2 and 0 < first.shape[0] <= GEMV_MAX_M and first.dtype in DTYPES[fold]):
        return None  # first, and cheap: a prefill step asks for every linear
    w_dtype = first.dtype if isinstance(w, Fp8Weight) else w.dtype  # e4m3 is read in x's dtype
    if all(t.dtype == first.dtype for t in (*tensors, bias) if t is not None) and w_dtype == first.dtype:
        return linear_plan.planned_config(fold, first, w, bias, functools.partial(run_path, fold, x))
    return None


def dense(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T + bias unfused: cuBLAS, or FP8_GEMM's path for FP8 weights (dequantized off an FP8 GPU)."""
    if not isinstance(w, Fp8Weight):
        return F.linear(x, w, bias)
    if FP8_GEMM in SCALED_MM and scaled_mm_supported(x, w):
        return scaled_mm_linear(x, w, bias, **SCALED_MM[FP8_GEMM])
    return F.linear(x, w.dequantize(x.dtype), bias)


def _norm_unfused(x: NormedInput, w: Weight, bias: torch.Tensor | None, swiglu: bool) -> torch.Tensor:
    rows = linear_plan.padded_rows(x.x, w, bias, dense)
    return norm_linear_ref(x, w, bias, functools.partial(linear, swiglu=swiglu), rows)


# fold -> its unfused path: the folded ops' own kernels around linear() ("norm+swiglu": the norm, then a swiglu linear).
UNFUSED = {
    "": dense,
    "swiglu": functools.partial(swiglu_linear_ref, linear=linear),
    "norm": functools.partial(_norm_unfused, swiglu=False),
    "norm+swiglu": functools.partial(_norm_unfused, swiglu=True),
}
