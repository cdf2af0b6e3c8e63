"""Linears of a few rows: a Triton GEMV with the residual add + RMSNorm before it folded into its loads (out[n] =
rstd * sum_k W[n, k] * norm_w[k] * s[k]) and SwiGLU into its stores; split-K partials summed in a fixed order."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.activation import silu_and_mul
from kernels.fp8 import Fp8Weight, fp8_dot, fp8_row_sums, fp8_scale_args, fp8_scales, fp8_tiles, fp8_to_f32, shift_tiles
from kernels.norm import add_rms_norm, rms_norm
from kernels.pdl import pdl_enabled, pdl_launch

GEMV_MAX_M = 16  # rows the Triton path takes: one tl.dot tile
BLOCK_M = 16
REDUCE_BLOCK = 1024


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    one_row: bool = False  # _gemv_row_kernel: x of exactly one row, split_k 1
    per_sm: int = 0  # one_row: programs per SM, each walking output blocks in turn; 0: a program a block
    max_regs: int = 0  # ptxas's register cap (maxnreg); 0: its own choice
    block_m: int = BLOCK_M  # the dot kernel's rows per program (more: a weight-only GEMM for many rows)
    ahead: int = 1  # one_row: W tiles loaded ahead of the one multiplied, 1 to 3 (e4m3 tiles: half the bytes)


@dataclass(frozen=True, slots=True)
class NormedInput:
    """rms_norm(x + residual) * weight, left to the linear that reads it, which may compute it inside its GEMV.
    That linear writes x + residual into residual_out (unless residual is None: then x is the new residual)."""

    x: torch.Tensor
    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    residual_out: torch.Tensor

    @classmethod
    def of(
        cls, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[NormedInput, torch.Tensor]:
        """(the normed input, the new residual x + residual), the latter written when a linear reads the former."""
        out = x if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return cls(x, residual, weight, eps, out), out


Input = torch.Tensor | NormedInput
Weight = torch.Tensor | Fp8Weight

# Tiles timed per shape (linear_plan.py): dot (block_n, block_k, warps, per_sm: sets split-K); one-row + max_regs.
_DOT_TILES = ((64, 128, 4, 2), (32, 256, 4, 2), (128, 128, 8, 2))
_ONE_ROW_TILES = (
    (8, 512, 4, 0, 0),
    (4, 2048, 8, 0, 0),
    (8, 2048, 8, 0, 0),
    (1, 2048, 4, 8, 0),
    (4, 2048, 4, 8, 0),
    (4, 2048, 4, 8, 168),
    (2, 2048, 4, 8, 0),
    (4, 2048, 8, 8, 0),
    (4, 2048, 4, 6, 168),
    (4, 2048, 4, 12, 128),
)


def swiglu_linear_ref(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, linear: Callable = F.linear
) -> torch.Tensor:
    """silu_and_mul(linear(x, w, bias)) for w = [gate | up], unfused."""
    return silu_and_mul(linear(x, w, bias))


def norm_linear_ref(
    x: NormedInput,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    linear: Callable = F.linear,
    rows: int | None = None,
) -> torch.Tensor:
    """linear(rms_norm(x.x + x.residual) * x.weight, w, bias) unfused (on `rows` padded rows if given)."""
    normed = (
        rms_norm(x.x, x.weight, x.eps, rows)
        if x.residual is None
        else add_rms_norm(x.x, x.residual, x.weight, x.eps, rows, x.residual_out)[0]
    )
    return linear(normed, w, bias)[: x.x.shape[0]]


@triton.jit
def _load_x(
    x_ptr,
    res_ptr,
    norm_w_ptr,
    new_res_ptr,
    offs,
    offs_k,
    mask,
    K,
    store_sum,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    # A tile of the GEMV's input at x's offsets `offs`, and the squares of s = x + residual (used under NORM).
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
def _finish(acc, sumsq, bias_ptr, offs_n, N, K, eps, NORM: tl.constexpr, HAS_BIAS: tl.constexpr):
    if NORM:
        acc = acc * (1.0 / tl.sqrt(sumsq / K + eps))[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _epilogue(
    acc,
    acc_up,
    sumsq,
    out_ptr,
    bias_ptr,
    sumsq_ptr,
    offs_m,
    offs_n,
    pid_n,
    pid_k,
    M,
    N,
    K,
    eps,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    SWIGLU: tl.constexpr,
):
    # PARTIAL: float32 partials [split, M, N] (and the rows' sums of squares [split, M]) for the reduce; else the
    # output, N columns wide (under SWIGLU the weight has 2N rows: acc_up holds the up rows').
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


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
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
    s, s_up = fp8_scales(scale_ptr, offs_n, k_start, N, stride_sn, stride_sk, SWIGLU, SCALE, SCALE_BN, SCALE_BK)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        offs_x = offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
        x, sq = _load_x(
            x_ptr,
            res_ptr,
            norm_w_ptr,
            new_res_ptr,
            offs_x,
            offs_k[None, :],
            (offs_m[:, None] < M) & (offs_k[None, :] < K),
            K,
            pid_n == 0,
            NORM,
            HAS_RESIDUAL,
        )
        if NORM:
            sumsq += tl.sum(sq, axis=1)
        if SCALE == 2:  # block scales: this K tile lies in one block
            s, s_up = fp8_scales(scale_ptr, offs_n, k0, N, stride_sn, stride_sk, SWIGLU, SCALE, SCALE_BN, SCALE_BK)
        w_mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
        acc += fp8_dot(x, tl.load(w_rows + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0), s, x_ptr, SCALE)
        if SWIGLU:
            w_up = tl.load(w_rows + N * stride_wn + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0)
            acc_up += fp8_dot(x, w_up, s_up, x_ptr, SCALE)
    if SCALE == 1:
        acc, acc_up = acc * s[None, :], acc_up * s_up[None, :]
    _epilogue(
        acc,
        acc_up,
        sumsq,
        out_ptr,
        bias_ptr,
        sumsq_ptr,
        offs_m,
        offs_n,
        pid_n,
        pid_k,
        M,
        N,
        K,
        eps,
        NORM,
        HAS_BIAS,
        PARTIAL,
        SWIGLU,
    )


@triton.jit
def _gemv_row_kernel(
    x_ptr,
    res_ptr,
    norm_w_ptr,
    new_res_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    N,
    K,
    k_tiles,
    eps,
    stride_xk,
    stride_wn,
    stride_wk,
    scale_ptr,
    stride_sn,
    stride_sk,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    SCALE: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    WHOLE_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    AHEAD: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program p takes output blocks p, p + G, ... and walks their K tiles as one loop, loading the tile AHEAD on
    # while it multiplies this one; products are reduced once a block, so loads never wait on a reduction.
    pid, num_programs = tl.program_id(0), tl.num_programs(0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    total = tl.cdiv(tl.cdiv(N, BLOCK_N) - pid, num_programs) * k_tiles
    w, w_up, s, s_up = _load_w_tiles(
        w_ptr,
        pid,
        0,
        N,
        K,
        stride_wn,
        stride_wk,
        scale_ptr,
        stride_sn,
        stride_sk,
        SCALE,
        SCALE_BN,
        SCALE_BK,
        SWIGLU,
        BLOCK_N,
        BLOCK_K,
    )
    w2, w2_up, s2, s2_up = _load_w_tiles(
        w_ptr,
        pid + 1 // k_tiles * num_programs,
        1 % k_tiles,
        N,
        K,
        stride_wn,
        stride_wk,
        scale_ptr,
        stride_sn,
        stride_sk,
        SCALE,
        SCALE_BN,
        SCALE_BK,
        SWIGLU,
        BLOCK_N,
        BLOCK_K,
    )  # the tiles after w: fewer AHEAD leave the last unread
    w3, w3_up, s3, s3_up = _load_w_tiles(
        w_ptr,
        pid + 2 // k_tiles * num_programs,
        2 % k_tiles,
        N,
        K,
        stride_wn,
        stride_wk,
        scale_ptr,
        stride_sn,
        stride_sk,
        SCALE,
        SCALE_BN,
        SCALE_BK,
        SWIGLU,
        BLOCK_N,
        BLOCK_K,
    )
    if PDL:
        tl.extra.cuda.gdc_wait()
    if WHOLE_K:  # x's one tile serves every block
        offs_k = tl.arange(0, BLOCK_K)
        x, sq = _load_x(
            x_ptr,
            res_ptr,
            norm_w_ptr,
            new_res_ptr,
            offs_k * stride_xk,
            offs_k,
            offs_k < K,
            K,
            pid == 0,
            NORM,
            HAS_RESIDUAL,
        )
        x = x.to(tl.float32)[None, :]
        sumsq = tl.zeros([1], dtype=tl.float32) + tl.sum(sq, axis=0)
        for i in range(total):
            w_next, w_up_next, s_next, s_up_next = _load_w_tiles(
                w_ptr,
                pid + (i + AHEAD) * num_programs,
                0,
                N,
                K,
                stride_wn,
                stride_wk,
                scale_ptr,
                stride_sn,
                stride_sk,
                SCALE,
                SCALE_BN,
                SCALE_BK,
                SWIGLU,
                BLOCK_N,
                BLOCK_K,
            )
            _store_block(
                fp8_row_sums(fp8_to_f32(w, s, SCALE) * x, s, SCALE),
                fp8_row_sums(fp8_to_f32(w_up, s_up, SCALE) * x, s_up, SCALE),
                sumsq,
                out_ptr,
                bias_ptr,
                pid + i * num_programs,
                N,
                K,
                eps,
                NORM,
                HAS_BIAS,
                SWIGLU,
                BLOCK_N,
            )
            w, w_up, s, s_up, w2, w2_up, s2, s2_up, w3, w3_up, s3, s3_up = shift_tiles(
                w2, w2_up, s2, s2_up, w3, w3_up, s3, s3_up, w_next, w_up_next, s_next, s_up_next, AHEAD
            )
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        sq_acc = tl.zeros([BLOCK_K], dtype=tl.float32)
        for i in range(total):
            w_next, w_up_next, s_next, s_up_next = _load_w_tiles(
                w_ptr,
                pid + (i + AHEAD) // k_tiles * num_programs,
                (i + AHEAD) % k_tiles,
                N,
                K,
                stride_wn,
                stride_wk,
                scale_ptr,
                stride_sn,
                stride_sk,
                SCALE,
                SCALE_BN,
                SCALE_BK,
                SWIGLU,
                BLOCK_N,
                BLOCK_K,
            )
            k_tile = i % k_tiles
            offs_k = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
            x, sq = _load_x(
                x_ptr,
                res_ptr,
                norm_w_ptr,
                new_res_ptr,
                offs_k * stride_xk,
                offs_k,
                offs_k < K,
                K,
                (pid == 0) & (i < k_tiles),
                NORM,
                HAS_RESIDUAL,
            )
            x = x.to(tl.float32)[None, :]
            acc += fp8_to_f32(w, s, SCALE) * x
            if SWIGLU:
                acc_up += fp8_to_f32(w_up, s_up, SCALE) * x
            if NORM:
                sq_acc += sq
            if k_tile == k_tiles - 1:  # the block's sums hold all of K
                _store_block(
                    fp8_row_sums(acc, s, SCALE),
                    fp8_row_sums(acc_up, s_up, SCALE),
                    tl.zeros([1], dtype=tl.float32) + tl.sum(sq_acc, axis=0),
                    out_ptr,
                    bias_ptr,
                    pid + i // k_tiles * num_programs,
                    N,
                    K,
                    eps,
                    NORM,
                    HAS_BIAS,
                    SWIGLU,
                    BLOCK_N,
                )
                acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
                acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
                sq_acc = tl.zeros([BLOCK_K], dtype=tl.float32)
            w, w_up, s, s_up, w2, w2_up, s2, s2_up, w3, w3_up, s3, s3_up = shift_tiles(
                w2, w2_up, s2, s2_up, w3, w3_up, s3, s3_up, w_next, w_up_next, s_next, s_up_next, AHEAD
            )


@triton.jit
def _store_block(
    sums,
    sums_up,
    sumsq,
    out_ptr,
    bias_ptr,
    block,
    N,
    K,
    eps,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    _epilogue(
        sums[None, :],
        sums_up[None, :],
        sumsq,
        out_ptr,
        bias_ptr,
        out_ptr,
        tl.arange(0, 1),
        offs_n,
        0,
        0,
        1,
        N,
        K,
        eps,
        NORM,
        HAS_BIAS,
        False,
        SWIGLU,
    )


@triton.jit
def _load_w_tiles(
    w_ptr,
    block,
    k_tile,
    N,
    K,
    stride_wn,
    stride_wk,
    scale_ptr,
    stride_sn,
    stride_sk,
    SCALE: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    SWIGLU: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # W's tile of output block `block` (and the up rows'), with their scales; a block past the last loads nothing.
    word: tl.constexpr = 4 if SCALE else 1  # e4m3 in int32 words of four: loaded bytes take a 16-bit register each
    w_ptr = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True) if SCALE else w_ptr
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = k_tile * (BLOCK_K // word) + tl.arange(0, BLOCK_K // word)
    ptrs = w_ptr + offs_n[:, None].to(tl.int64) * (stride_wn // word) + offs_k[None, :] * stride_wk
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K // word)
    w = tl.load(ptrs, mask=mask, other=0.0)
    w_up = tl.load(ptrs + N * (stride_wn // word), mask=mask, other=0.0) if SWIGLU else w
    s, s_up = fp8_scales(
        scale_ptr, offs_n, k_tile * BLOCK_K, N, stride_sn, stride_sk, SWIGLU, SCALE, SCALE_BN, SCALE_BK
    )
    return w, w_up, s, s_up


@triton.jit(do_not_specialize=["MN", "SPLIT_K"])
def _split_k_reduce_kernel(
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


def gemv_triton(
    x: Input, w: Weight, bias: torch.Tensor | None, config: GemvConfig, swiglu: bool = False
) -> torch.Tensor:
    """F.linear(x, w, bias) by the Triton GEMV, then SwiGLU with swiglu; a NormedInput's norm runs in its loads (the
    new residual into residual_out); x may be strided; an Fp8Weight is read as e4m3, scaled in registers."""
    residual = norm_weight = new_res = None
    eps = 0.0
    if isinstance(x, NormedInput):
        norm_weight, eps = x.weight, x.eps
        if x.residual is not None:
            residual, new_res = x.residual.contiguous(), x.residual_out
        x = x.x.contiguous()  # the residual, new residual and x share one layout
    scale_args, scale_meta = fp8_scale_args(w, config, swiglu)
    w = w.weight if isinstance(w, Fp8Weight) else w
    (n, k), m, cfg = w.shape, x.shape[0], config
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns for a weight of {k}: pass x[M, K] for w[N, K]")
    if swiglu and (n % 2 or cfg.split_k > 1):
        raise ValueError(
            f"the SwiGLU epilogue needs w = [gate | up] (an even row count, got {n}) and all of K in "
            f"one program (split_k = 1, got {cfg.split_k}): use candidate_configs(..., swiglu=True)"
        )
    if cfg.one_row and (m != 1 or cfg.split_k > 1):
        raise ValueError(
            f"{cfg} takes exactly one row of x (got {m}) and all of K in a program (split_k 1, got "
            f"{cfg.split_k}); use a config with one_row=False"
        )
    n_out = n // 2 if swiglu else n
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    partial, norm = cfg.split_k > 1, norm_weight is not None
    target = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device) if partial else out
    sumsq = torch.empty((cfg.split_k, m), dtype=torch.float32, device=x.device) if partial and norm else w
    _or_w = lambda t: w if t is None else t  # noqa: E731  (tensors a variant does not read: never dereferenced)
    pointers = (x, _or_w(residual), _or_w(norm_weight), _or_w(new_res), w, _or_w(bias), target)
    meta = dict(
        NORM=norm,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None and not partial,
        SWIGLU=swiglu,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        PDL=pdl_enabled(x.device),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **scale_meta,
    )
    if cfg.max_regs:
        meta["maxnreg"] = cfg.max_regs
    if cfg.one_row:
        blocks, k_tiles = triton.cdiv(n_out, cfg.block_n), triton.cdiv(k, cfg.block_k)
        grid = min(blocks, cfg.per_sm * num_sms(x.device)) if cfg.per_sm else blocks
        _gemv_row_kernel[(grid,)](
            *pointers,
            n_out,
            k,
            k_tiles,
            eps,
            x.stride(1),
            w.stride(0),
            w.stride(1),
            *scale_args,
            WHOLE_K=k_tiles == 1,
            AHEAD=cfg.ahead,
            **meta,
            **pdl_launch(x.device),
        )
    else:
        grid = (triton.cdiv(n_out, cfg.block_n), cfg.split_k, triton.cdiv(m, cfg.block_m))
        k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
        _gemv_kernel[grid](
            *pointers,
            sumsq,
            m,
            n_out,
            k,
            k_per_split,
            eps,
            x.stride(0),
            x.stride(1),
            w.stride(0),
            w.stride(1),
            *scale_args,
            PARTIAL=partial,
            BLOCK_M=cfg.block_m,
            **meta,
        )
    if partial:
        _split_k_reduce_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            target,
            sumsq,
            _or_w(bias),
            out,
            m * n,
            n,
            k,
            cfg.split_k,
            eps,
            NORM=norm,
            HAS_BIAS=bias is not None,
            BLOCK=REDUCE_BLOCK,
        )
    return out


def candidate_configs(
    n: int, k: int, num_sms: int, rows: int = GEMV_MAX_M, swiglu: bool = False, fp8_block: tuple[int, int] | None = None
) -> list[GemvConfig]:
    """Tiles worth timing for an [n, k] weight (FP8 with fp8_block's scales) and `rows` rows (the one-row kernel's
    too for 1); a dot tile's K splits until it has its programs per SM (never with swiglu: it needs all of K)."""
    dot_tiles, one_row_tiles = fp8_tiles(fp8_block) if fp8_block else (_DOT_TILES, _ONE_ROW_TILES)
    configs = []
    for block_n, block_k, warps, per_sm in dot_tiles:
        chunks = triton.cdiv(k, block_k)
        wanted = triton.cdiv(per_sm * num_sms, triton.cdiv(n, block_n))
        per_split = chunks if swiglu else max(1, chunks // wanted)  # whole chunks a split: >= `wanted` splits
        configs.append(GemvConfig(block_n, block_k, triton.cdiv(chunks, per_split), warps))
    if rows == 1:
        configs += [
            GemvConfig(block_n, block_k, 1, warps, one_row=True, per_sm=per_sm, max_regs=regs, ahead=(*ahead, 1)[0])
            for block_n, block_k, warps, per_sm, regs, *ahead in one_row_tiles
        ]
    return configs


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: any count gives the same result
    return torch.cuda.get_device_properties(device).multi_processor_count
