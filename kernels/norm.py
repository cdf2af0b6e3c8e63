"""RMSNorm, alone and fused with the residual add that precedes it in every decoder layer."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enabled


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, in float32, rounded the way Hugging Face's Qwen2RMSNorm rounds."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, stride_x, stride_res, stride_out,
                     stride_new_res, hidden, eps, ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    # One program per row: a whole row fits in registers, so it is read once.
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        # The sum rounded to the input dtype before normalising, as the unfused torch code does.
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(new_res_ptr.dtype.element_ty)
        tl.store(new_res_ptr + row * stride_new_res + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                    rows: int | None = None,
                    residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(s), s) for s = x + residual (into residual_out if given), or (rms_norm(x), None) without one."""
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError(f"rms_norm needs a unit stride on the hidden dim, got {x.stride()}; pass x.contiguous()")
    n, hidden = x.shape
    out = torch.empty((_out_rows(n, rows), hidden), dtype=torch.result_type(x, weight), device=x.device)
    res, new_res = x, out  # never touched without a residual: ADD_RESIDUAL is off
    if residual is not None:
        res = residual
        new_res = torch.empty((n, hidden), dtype=x.dtype, device=x.device) if residual_out is None else residual_out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(n,)](x, res, weight, out, new_res, x.stride(0), res.stride(0), out.stride(0),
                           new_res.stride(0), hidden, eps, ADD_RESIDUAL=residual is not None, BLOCK=block,
                           PDL=pdl_enabled(x.device), num_warps=min(16, max(1, block // 256)))
    return out, (new_res if residual is not None else None)


def _out_rows(n: int, rows: int | None) -> int:
    if rows is not None and rows < n:
        raise ValueError(f"rows={rows} is under the input's {n}: pass None or at least {n}")
    return n if rows is None else rows


def _padded(out: torch.Tensor, rows: int | None) -> torch.Tensor:
    # The reference's output in a buffer of `rows` rows, as the Triton launch allocates it.
    extra = _out_rows(out.shape[0], rows) - out.shape[0]
    return torch.cat([out, out.new_empty((extra, *out.shape[1:]))]) if extra else out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, rows: int | None = None) -> torch.Tensor:
    """x[T, H] -> RMSNorm(x) * weight, in a buffer of `rows` rows (>= T, those past T unset) if given."""
    if x.is_cuda:
        return rms_norm_triton(x, None, weight, eps, rows)[0]
    return _padded(rms_norm_ref(x, weight, eps), rows)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 rows: int | None = None,
                 residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual, rows=rows), x + residual), the latter into residual_out if given; one pass on CUDA."""
    if x.is_cuda:
        return rms_norm_triton(x, residual, weight, eps, rows, residual_out)
    new_residual = torch.add(x, residual, out=residual_out)  # in the input dtype, as the kernel rounds it
    return _padded(rms_norm_ref(new_residual, weight, eps), rows), new_residual
