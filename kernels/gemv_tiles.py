"""What both GEMV kernels share: a tile of x with the residual add + RMSNorm folded into its loads, a tile's FP8
scales, and the epilogue (rstd, bias, SwiGLU) that stores the output or the split-K partials."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_x(xs, offs, offs_k, mask, K, store_sum, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    # A tile of the GEMV's input at x's offsets `offs`, and the squares of s = x + residual (used under NORM).
    x_ptr, res_ptr, norm_w_ptr, new_res_ptr = xs
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # s rounded to the dtype, as add_rms_norm does
        x = x.to(tl.float32) + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = x.to(x_ptr.dtype.element_ty)
        tl.store(new_res_ptr + offs, x, mask=tl.where(store_sum, mask, False))  # (a & scalar: the interpreter fails)
    xf = x.to(tl.float32)
    if NORM:  # norm_w * s; rstd scales the sums once they hold all of K
        x = xf * tl.load(norm_w_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    return x, xf * xf


@triton.jit
def fp8_scales(
    scales, offs_n, k0, N, SWIGLU: tl.constexpr, SCALE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr
):
    # The scales of rows offs_n (and of the up rows, offs_n + N) at column k0; zeros without SCALE (unread).
    scale_ptr, stride_sn, stride_sk = scales
    s = tl.zeros(offs_n.shape, dtype=tl.float32)
    s_up = s
    if SCALE:
        ptrs = scale_ptr + (offs_n // SCALE_BN) * stride_sn
        if SCALE == 2:
            ptrs += (k0 // SCALE_BK) * stride_sk
        s = tl.load(ptrs, mask=offs_n < N, other=0.0)
        if SWIGLU:
            s_up = tl.load(ptrs + (N // SCALE_BN) * stride_sn, mask=offs_n < N, other=0.0)
    return s, s_up


@triton.jit
def _finish(acc, sumsq, bias_ptr, offs_n, N, K, eps, NORM: tl.constexpr, HAS_BIAS: tl.constexpr):
    if NORM:
        acc = acc * (1.0 / tl.sqrt(sumsq / K + eps))[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def epilogue(
    acc,
    acc_up,
    sumsq,
    outs,
    offs_m,
    offs_n,
    pid_n,
    pid_k,
    M,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    SWIGLU: tl.constexpr,
):
    # PARTIAL: float32 partials [split, M, N] (and the rows' sums of squares [split, M]) for the reduce; else the
    # output, N columns wide (under SWIGLU the weight has 2N rows: acc_up holds the up rows').
    out_ptr, bias_ptr, sumsq_ptr, N, K, eps = outs
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if PARTIAL:
        tl.store(out_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)
        if NORM:
            tl.store(sumsq_ptr + pid_k * M + offs_m, sumsq, mask=tl.where(pid_n == 0, offs_m < M, False))
    else:
        dtype = out_ptr.dtype.element_ty
        out = _finish(acc, sumsq, bias_ptr, offs_n, N, K, eps, NORM, HAS_BIAS).to(dtype)
        if SWIGLU:  # gate and up rounded to the dtype, then silu, then the product: silu_and_mul's roundings
            gate = out.to(tl.float32)
            up = _finish(acc_up, sumsq, bias_ptr + N, offs_n, N, K, eps, NORM, HAS_BIAS).to(dtype).to(tl.float32)
            out = ((gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up).to(dtype)
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], out, mask=mask)
