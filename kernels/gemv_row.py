"""The GEMV of exactly one row on CUDA cores: each program walks its output blocks' W tiles as one stream, up to
three tiles ahead of the one it multiplies; e4m3 weights are read in int32 words of four."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.gemv_tiles import epilogue, fp8_scales, load_x


@triton.jit
def gemv_row_kernel(
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
    ws, scales = (w_ptr, N, K, stride_wn, stride_wk), (scale_ptr, stride_sn, stride_sk)
    xs, outs = (x_ptr, res_ptr, norm_w_ptr, new_res_ptr), (out_ptr, bias_ptr, out_ptr, N, K, eps)
    w, w_up, s, s_up = _load_w_tiles(ws, scales, pid, 0, SWIGLU, SCALE, SCALE_BN, SCALE_BK, BLOCK_N, BLOCK_K)
    # The tiles after w: fewer AHEAD leave the last unread.
    w2, w2_up, s2, s2_up = _load_w_tiles(
        ws, scales, pid + 1 // k_tiles * num_programs, 1 % k_tiles, SWIGLU, SCALE, SCALE_BN, SCALE_BK, BLOCK_N, BLOCK_K
    )
    w3, w3_up, s3, s3_up = _load_w_tiles(
        ws, scales, pid + 2 // k_tiles * num_programs, 2 % k_tiles, SWIGLU, SCALE, SCALE_BN, SCALE_BK, BLOCK_N, BLOCK_K
    )
    if PDL:
        tl.extra.cuda.gdc_wait()
    if WHOLE_K:  # x's one tile serves every block
        offs_k = tl.arange(0, BLOCK_K)
        x, sq = load_x(xs, offs_k * stride_xk, offs_k, offs_k < K, K, pid == 0, NORM, HAS_RESIDUAL)
        x = x.to(tl.float32)[None, :]
        sumsq = tl.zeros([1], dtype=tl.float32) + tl.sum(sq, axis=0)
        for i in range(total):
            w_next, w_up_next, s_next, s_up_next = _load_w_tiles(
                ws, scales, pid + (i + AHEAD) * num_programs, 0, SWIGLU, SCALE, SCALE_BN, SCALE_BK, BLOCK_N, BLOCK_K
            )
            sums = _row_sums(_to_f32(w, s, SCALE) * x, s, SCALE)
            sums_up = _row_sums(_to_f32(w_up, s_up, SCALE) * x, s_up, SCALE)
            _store_block(sums, sums_up, sumsq, outs, pid + i * num_programs, NORM, HAS_BIAS, SWIGLU, BLOCK_N)
            w, w_up, s, s_up, w2, w2_up, s2, s2_up, w3, w3_up, s3, s3_up = _shift_tiles(
                w2, w2_up, s2, s2_up, w3, w3_up, s3, s3_up, w_next, w_up_next, s_next, s_up_next, AHEAD
            )
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        sq_acc = tl.zeros([BLOCK_K], dtype=tl.float32)
        for i in range(total):
            w_next, w_up_next, s_next, s_up_next = _load_w_tiles(
                ws,
                scales,
                pid + (i + AHEAD) // k_tiles * num_programs,
                (i + AHEAD) % k_tiles,
                SWIGLU,
                SCALE,
                SCALE_BN,
                SCALE_BK,
                BLOCK_N,
                BLOCK_K,
            )
            k_tile = i % k_tiles
            offs_k = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
            x, sq = load_x(
                xs, offs_k * stride_xk, offs_k, offs_k < K, K, (pid == 0) & (i < k_tiles), NORM, HAS_RESIDUAL
            )
            x = x.to(tl.float32)[None, :]
            acc += _to_f32(w, s, SCALE) * x
            if SWIGLU:
                acc_up += _to_f32(w_up, s_up, SCALE) * x
            if NORM:
                sq_acc += sq
            if k_tile == k_tiles - 1:  # the block's sums hold all of K
                sums, sums_up = _row_sums(acc, s, SCALE), _row_sums(acc_up, s_up, SCALE)
                sumsq = tl.zeros([1], dtype=tl.float32) + tl.sum(sq_acc, axis=0)
                _store_block(
                    sums, sums_up, sumsq, outs, pid + i // k_tiles * num_programs, NORM, HAS_BIAS, SWIGLU, BLOCK_N
                )
                acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
                acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
                sq_acc = tl.zeros([BLOCK_K], dtype=tl.float32)
            w, w_up, s, s_up, w2, w2_up, s2, s2_up, w3, w3_up, s3, s3_up = _shift_tiles(
                w2, w2_up, s2, s2_up, w3, w3_up, s3, s3_up, w_next, w_up_next, s_next, s_up_next, AHEAD
            )


@triton.jit
def _store_block(
    sums,
    sums_up,
    sumsq,
    outs,
    block,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    epilogue(
        sums[None, :], sums_up[None, :], sumsq, outs, tl.arange(0, 1), offs_n, 0, 0, 1, NORM, HAS_BIAS, False, SWIGLU
    )


@triton.jit
def _load_w_tiles(
    ws,
    scales,
    block,
    k_tile,
    SWIGLU: tl.constexpr,
    SCALE: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # W's tile of output block `block` (and the up rows'), with their scales; a block past the last loads nothing.
    w_ptr, N, K, stride_wn, stride_wk = ws
    word: tl.constexpr = 4 if SCALE else 1  # e4m3 in int32 words of four: loaded bytes take a 16-bit register each
    w_ptr = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True) if SCALE else w_ptr
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = k_tile * (BLOCK_K // word) + tl.arange(0, BLOCK_K // word)
    ptrs = w_ptr + offs_n[:, None].to(tl.int64) * (stride_wn // word) + offs_k[None, :] * stride_wk
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K // word)
    w = tl.load(ptrs, mask=mask, other=0.0)
    w_up = tl.load(ptrs + N * (stride_wn // word), mask=mask, other=0.0) if SWIGLU else w
    s, s_up = fp8_scales(scales, offs_n, k_tile * BLOCK_K, N, SWIGLU, SCALE, SCALE_BN, SCALE_BK)
    return w, w_up, s, s_up


@triton.jit
def _to_f32(w, s, SCALE: tl.constexpr):
    # A [BLOCK_N, BLOCK_K] tile in float32 from int32 words of four e4m3, times its block scales (per-row: on the sums).
    if SCALE:
        w = tl.join(tl.join(w, w >> 16), tl.join(w >> 8, w >> 24)).to(tl.int8).to(tl.float8e4nv, bitcast=True)
        w = tl.reshape(w, [w.shape[0], w.shape[1] * 4])
    w = w.to(tl.float32)
    if SCALE == 2:
        w = w * s[:, None]
    return w


@triton.jit
def _row_sums(products, s, SCALE: tl.constexpr):
    sums = tl.sum(products, axis=1)
    if SCALE == 1:
        sums = sums * s
    return sums


@triton.jit
def _shift_tiles(w2, w2_up, s2, s2_up, w3, w3_up, s3, s3_up, w_next, w_up_next, s_next, s_up_next, AHEAD: tl.constexpr):
    # (tile to multiply next, the one after it, the one after that): AHEAD 1 leaves the last two unread.
    if AHEAD == 1:
        return w_next, w_up_next, s_next, s_up_next, w2, w2_up, s2, s2_up, w3, w3_up, s3, s3_up
    if AHEAD == 2:
        return w2, w2_up, s2, s2_up, w_next, w_up_next, s_next, s_up_next, w3, w3_up, s3, s3_up
    return w2, w2_up, s2, s2_up, w3, w3_up, s3, s3_up, w_next, w_up_next, s_next, s_up_next
