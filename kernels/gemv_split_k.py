"""The GEMV of up to BLOCK_M rows on tensor cores (one tl.dot tile), K split over programs into float32 partials
that a second kernel sums in a fixed order."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.gemv_tiles import epilogue, fp8_scales, load_x


@triton.jit
def _fp8_dot(x, w, s, x_ptr, SCALE: tl.constexpr):
    # x @ w for a [BLOCK_K, BLOCK_N] tile; an e4m3 one in the activations' dtype, times its block scales (per-row
    # scales go on the sums).
    if SCALE:
        w = w.to(x_ptr.dtype.element_ty)
    prod = tl.dot(x.to(w.dtype), w)
    if SCALE == 2:
        prod = prod * s[None, :]
    return prod


@triton.jit(do_not_specialize=["M"])
def gemv_kernel(
    x_ptr,
    res_ptr,
    norm_w_ptr,
    new_res_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    sumsq_ptr,
    M,
    N,
    K,
    k_per_split,
    eps,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    scale_ptr,
    stride_sn,
    stride_sk,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    SWIGLU: tl.constexpr,
    SCALE: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (n, s, m): a BLOCK_M x BLOCK_N tile of the output over split s of K.
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    w_rows = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn  # the tile is loaded as w^T: [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    xs, scales = (x_ptr, res_ptr, norm_w_ptr, new_res_ptr), (scale_ptr, stride_sn, stride_sk)
    s, s_up = fp8_scales(scales, offs_n, k_start, N, SWIGLU, SCALE, SCALE_BN, SCALE_BK)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        offs_x = offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
        x_mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        x, sq = load_x(xs, offs_x, offs_k[None, :], x_mask, K, pid_n == 0, NORM, HAS_RESIDUAL)
        if NORM:
            sumsq += tl.sum(sq, axis=1)
        if SCALE == 2:  # block scales: this K tile lies in one block
            s, s_up = fp8_scales(scales, offs_n, k0, N, SWIGLU, SCALE, SCALE_BN, SCALE_BK)
        w_mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
        acc += _fp8_dot(x, tl.load(w_rows + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0), s, x_ptr, SCALE)
        if SWIGLU:
            w_up = tl.load(w_rows + N * stride_wn + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0)
            acc_up += _fp8_dot(x, w_up, s_up, x_ptr, SCALE)
    if SCALE == 1:
        acc, acc_up = acc * s[None, :], acc_up * s_up[None, :]
    outs = (out_ptr, bias_ptr, sumsq_ptr, N, K, eps)
    epilogue(acc, acc_up, sumsq, outs, offs_m, offs_n, pid_n, pid_k, M, NORM, HAS_BIAS, PARTIAL, SWIGLU)


@triton.jit(do_not_specialize=["MN", "SPLIT_K"])
def split_k_reduce_kernel(
    part_ptr,
    sumsq_ptr,
    bias_ptr,
    out_ptr,
    MN,
    N,
    K,
    SPLIT_K,
    eps,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Sums the partials split 0, 1, ... in this order: the same bits every run, unlike atomic adds.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
        if NORM:
            sumsq += tl.load(sumsq_ptr + s * (MN // N) + offs // N, mask=mask, other=0.0)
    if NORM:
        acc = acc * (1.0 / tl.sqrt(sumsq / K + eps))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
