"""Which path runs a linear: for a few rows on the GPU, the Triton GEMV of kernels/gemv.py with the ops around the
linear folded in, wherever kernels/linear_plan.py timed it faster; otherwise the unfused path, those ops' own
kernels around the plain linear's pick (cuBLAS, or the GEMV) on padded rows where cuBLAS is faster so.

The fold names what the GEMV takes in: "" (the plain linear), "norm" (the residual add + RMSNorm before it, given
as a NormedInput), "swiglu" (SwiGLU after it) or "norm+swiglu". Off the GPU, in float32 (float16 too for the norm)
and past GEMV_MAX_M rows, every fold runs unfused.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels import linear_plan
from kernels.gemv import (GEMV_MAX_M, GemvConfig, gemv_triton, linear_ref, norm_gemv_triton, norm_linear_ref,
                          swiglu_linear_ref)

# The dtypes each fold's Triton path takes. The norm's tensor-core tile holds norm_w * s, not the normed s:
# float16's range cannot hold that where the residual stream is large, bfloat16's can.
DTYPES = {"": (torch.float16, torch.bfloat16), "norm": (torch.bfloat16,), "swiglu": (torch.float16, torch.bfloat16),
          "norm+swiglu": (torch.bfloat16,)}


@dataclass(frozen=True, slots=True)
class NormedInput:
    """rms_norm(x + residual) * weight, left to the linear that reads it, which may compute it inside its GEMV.
    That linear writes x + residual into residual_out (x itself when residual is None: nothing to write)."""

    x: torch.Tensor
    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    residual_out: torch.Tensor | None = None  # None: the linear allocates it (and nobody reads it)

    @classmethod
    def of(cls, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
           eps: float) -> tuple[NormedInput, torch.Tensor]:
        """(the normed input, the new residual x + residual), the latter written when a linear reads the former."""
        out = x if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return cls(x, residual, weight, eps, out), out


Input = torch.Tensor | NormedInput


def linear(x: Input, w: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
    """x[M, K] @ w[N, K]^T + bias, then silu(gate) * up of w = [gate | up] with swiglu; x may be a NormedInput."""
    fold = ("norm+swiglu" if swiglu else "norm") if isinstance(x, NormedInput) else ("swiglu" if swiglu else "")
    return run_path(fold, x, w, bias, choice(fold, x, w, bias))


def run_path(fold: str, x: Input, w: torch.Tensor, bias: torch.Tensor | None,
             config: GemvConfig | None) -> torch.Tensor:
    """The op by the Triton GEMV with this config, or by its unfused path for None."""
    unfused, fused = PATHS[fold]
    return unfused(x, w, bias) if config is None else fused(x, w, bias, config)


def choice(fold: str, x: Input, w: torch.Tensor, bias: torch.Tensor | None) -> GemvConfig | None:
    """The Triton config this call runs, or None for the unfused path."""
    tensors = (x.x, x.residual, x.weight, x.residual_out) if isinstance(x, NormedInput) else (x,)
    first = tensors[0]
    if not (first.is_cuda and first.dim() == 2 and 0 < first.shape[0] <= GEMV_MAX_M and first.dtype in DTYPES[fold]):
        return None  # first, and cheap: a prefill step asks for every linear
    if all(t.dtype == first.dtype for t in (*tensors, w, bias) if t is not None):
        return linear_plan.planned_config(fold, first, w, bias, functools.partial(run_path, fold, x))
    return None


def timed_choice(fold: str, inputs: tuple, w: torch.Tensor,
                 bias: torch.Tensor | None = None) -> tuple[GemvConfig | None, float, float]:
    """(the choice, µs of the unfused path, µs of the chosen one) for inputs (x,), or (x, residual, norm weight,
    eps) with the norm, each over cold weights in a CUDA graph: what bench.kernels and the GPU tests report."""
    x = NormedInput(*inputs) if fold.startswith("norm") else inputs[0]
    config = choice(fold, x, w, bias)
    op, copies = functools.partial(run_path, fold, x), linear_plan.cold_copies(w, bias)
    return config, linear_plan.op_us(op, copies, None), linear_plan.op_us(op, copies, config)


def _norm_unfused(x: NormedInput, w: torch.Tensor, bias: torch.Tensor | None, swiglu: bool) -> torch.Tensor:
    then = functools.partial(linear, swiglu=swiglu)
    rows = linear_plan.padded_rows(x.x, w, bias)
    return norm_linear_ref(x.x, x.residual, x.weight, x.eps, w, bias, then, rows, x.residual_out)[0]


def _norm_fused(x: NormedInput, w: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig,
                swiglu: bool) -> torch.Tensor:
    return norm_gemv_triton(x.x, x.residual, x.weight, x.eps, w, bias, config, swiglu, x.residual_out)[0]


# fold -> (unfused path, fused Triton GEMV): both take (x, w, bias), the Triton one a config after. An unfused
# path runs the folded ops' own kernels around linear(), so "norm+swiglu" unfused is the norm, then
# linear(..., swiglu=True)'s own pick.
PATHS = {"": (linear_ref, gemv_triton),
         "swiglu": (functools.partial(swiglu_linear_ref, linear=linear), functools.partial(gemv_triton, swiglu=True)),
         "norm": (functools.partial(_norm_unfused, swiglu=False), functools.partial(_norm_fused, swiglu=False)),
         "norm+swiglu": (functools.partial(_norm_unfused, swiglu=True), functools.partial(_norm_fused, swiglu=True))}
