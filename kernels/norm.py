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
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    new_res_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_new_res,
    hidden,
    eps,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per row: a whole row fits in registers, so it is read once.
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        # The sum rounded to the input dtype before normalising, as the unfused torch code does.
        x = x.to(tl.float32) + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(new_res_ptr.dtype.element_ty)
        tl.store(new_res_ptr + row * stride_new_res + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    rows: int | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
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
    _rms_norm_kernel[(n,)](
        x,
        res,
        weight,
        out,
        new_res,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        new_res.stride(0),
        hidden,
        eps,
        ADD_RESIDUAL=residual is not None,
        BLOCK=block,
        PDL=pdl_enabled(x.device),
        num_warps=min(16, max(1, block // 256)),
    )
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


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    rows: int | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual, rows=rows), x + residual), the latter into residual_out if given; one pass on CUDA."""
    if x.is_cuda:
        return rms_norm_triton(x, residual, weight, eps, rows, residual_out)
    new_residual = torch.add(x, residual, out=residual_out)  # in the input dtype, as the kernel rounds it
    return _padded(rms_norm_ref(new_residual, weight, eps), rows), new_residual


@triton.jit
def _norm_heads(
    x_ptr, w_ptr, stride_h, heads, eps, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, D_PAD: tl.constexpr
):
    """RMSNorm of each of `heads` rows of HEAD_DIM at x_ptr (rows stride_h apart), in place."""
    offs_h = tl.arange(0, HEADS_PAD)[:, None]
    offs_d = tl.arange(0, D_PAD)[None, :]
    mask = (offs_h < heads) & (offs_d < HEAD_DIM)
    ptrs = x_ptr + offs_h * stride_h + offs_d
    xf = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)
    normed = (xf * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs_d, mask=offs_d < HEAD_DIM, other=0.0).to(tl.float32)
    tl.store(ptrs, (normed * w).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_kernel(
    q_ptr,
    k_ptr,
    q_w_ptr,
    k_w_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    q_heads,
    k_heads,
    eps,
    HEAD_DIM: tl.constexpr,
    Q_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per token normalises all its q and k heads: q and k are strided views of the qkv output.
    if PDL:  # the attention after this may start its work that does not read q and k (kernels/pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    _norm_heads(q_ptr + t * stride_qt, q_w_ptr, stride_qh, q_heads, eps, HEAD_DIM, Q_PAD, D_PAD)
    _norm_heads(k_ptr + t * stride_kt, k_w_ptr, stride_kh, k_heads, eps, HEAD_DIM, K_PAD, D_PAD)


def qk_rms_norm_ref(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
) -> None:
    q.copy_(rms_norm_ref(q, q_weight, eps))
    k.copy_(rms_norm_ref(k, k_weight, eps))


def qk_rms_norm_triton(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
) -> None:
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"qk_rms_norm needs a unit stride on head_dim, got {q.stride()} and {k.stride()}")
    d = q.shape[-1]
    _qk_norm_kernel[(q.shape[0],)](
        q,
        k,
        q_weight,
        k_weight,
        *q.stride()[:2],
        *k.stride()[:2],
        q.shape[1],
        k.shape[1],
        eps,
        HEAD_DIM=d,
        Q_PAD=triton.next_power_of_2(q.shape[1]),
        K_PAD=triton.next_power_of_2(k.shape[1]),
        D_PAD=triton.next_power_of_2(d),
        PDL=pdl_enabled(q.device),
    )


def qk_rms_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float) -> None:
    """RMSNorm over each head of q [T, Hq, D] and of k [T, Hk, D], in place, in one launch on CUDA."""
    (qk_rms_norm_triton if q.is_cuda else qk_rms_norm_ref)(q, k, q_weight, k_weight, eps)
