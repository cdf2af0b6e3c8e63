"""SwiGLU activation: silu(gate) * up over the fused gate_up projection output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.pdl import pdl_enabled

_BLOCK = 1024


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # silu rounded to the input dtype before the product: the torch reference's two roundings.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul needs a unit stride on the last dim, got {x.stride()}; pass x.contiguous()")
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, _BLOCK))](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=_BLOCK, PDL=pdl_enabled(x.device)
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x[T, 2I] -> silu(x[:, :I]) * x[:, I:]."""
    return silu_and_mul_triton(x) if x.is_cuda else silu_and_mul_ref(x)
