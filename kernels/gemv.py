"""Linears of a few rows: a Triton GEMV with the residual add + RMSNorm before it folded into its loads (out[n] =
rstd * sum_k W[n, k] * norm_w[k] * s[k]) and SwiGLU into its stores; split-K partials summed in a fixed order."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from kernels.activation import silu_and_mul
from kernels.fp8 import Fp8Weight
from kernels.gemv_row import gemv_row_kernel
from kernels.gemv_split_k import gemv_kernel, split_k_reduce_kernel
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
    one_row: bool = False  # gemv_row_kernel: x of exactly one row, split_k 1
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

# Tiles the linear plan times per shape: dot (block_n, block_k, warps, per_sm: sets split-K); one-row + max_regs.
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


# FP8 weights' tiles. An e4m3 tile is half a bf16 one's bytes, so the one-row tiles load 2-3
# ahead (the 6th field) and some cap registers (the 5th) for more programs per SM: a latency-bound stream needs at
# least as many weight bytes in flight per SM as bf16's best tiles keep.
_FP8_DOT_TILES = ((64, 128, 4, 2), (32, 256, 4, 2), (128, 128, 8, 2), (64, 256, 4, 2))
_FP8_ONE_ROW_TILES = (
    (4, 2048, 4, 8, 0, 3),
    (2, 2048, 4, 8, 88, 3),
    (1, 2048, 4, 12, 56, 3),
    (2, 2048, 4, 8, 72, 2),
    (2, 2048, 4, 8, 80, 2),
    (4, 2048, 4, 8, 0, 2),
    (2, 2048, 4, 8, 0, 2),
    (4, 2048, 8, 0, 0, 1),
    (8, 2048, 8, 0, 0, 2),
)
_FP8_BLOCK_DOT_TILES = ((64, 128, 4, 2), (32, 128, 4, 2), (128, 128, 8, 2))
_FP8_BLOCK_ONE_ROW_TILES = (
    (16, 128, 4, 8, 0, 2),
    (32, 128, 8, 0, 0, 2),
    (32, 128, 8, 8, 0),
    (64, 128, 8, 0, 0),
    (32, 128, 4, 8, 0, 2),
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


def fp8_tiles(block: tuple[int, int]) -> tuple[list[tuple], list[tuple]]:
    """(dot tiles, one-row tiles) of the GEMV worth timing for FP8 weights with scales of this block."""
    if not block[1]:
        return list(_FP8_DOT_TILES), list(_FP8_ONE_ROW_TILES)
    clip = lambda tiles: [(n, min(k, block[1]), *rest) for n, k, *rest in tiles]  # noqa: E731
    return clip(_FP8_BLOCK_DOT_TILES), clip(_FP8_BLOCK_ONE_ROW_TILES)


def fp8_scale_args(w: torch.Tensor | Fp8Weight, config: GemvConfig, swiglu: bool) -> tuple[tuple, dict]:
    """((scales, their strides), the GEMV's SCALE (0 none, 1 a row, 2 a block), SCALE_BN, SCALE_BK) for w."""
    if not isinstance(w, Fp8Weight):
        return (w, 0, 0), {"SCALE": 0, "SCALE_BN": 1, "SCALE_BK": 1}
    rows, cols = w.block
    if cols and cols % config.block_k or swiglu and w.shape[0] // 2 % rows:
        raise ValueError(
            f"{config} does not fit FP8 scale blocks of {w.block}: a K tile must lie in one block "
            "(block_k dividing it) and gate | up must split between row blocks; take a config of "
            "candidate_configs(..., fp8_block) for these scales"
        )
    if config.one_row and (w.weight.stride(1) != 1 or (w.shape[1] | w.weight.stride(0) | w.weight.data_ptr()) % 4):
        raise ValueError(
            f"one-row GEMVs read e4m3 in int32 words: K {w.shape[1]} (stride {w.weight.stride()}) "
            "and the address must be multiples of 4; pass a contiguous weight or one_row=False"
        )
    return (
        (w.scale, w.scale.stride(0), w.scale.stride(1)),
        {"SCALE": 2 if cols else 1, "SCALE_BN": rows, "SCALE_BK": cols or 1},
    )


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
        gemv_row_kernel[(grid,)](
            *pointers,
            n_out,
            k,
            k_tiles,
            eps,
            x.stride(1),
            *w.stride(),
            *scale_args,
            WHOLE_K=k_tiles == 1,
            AHEAD=cfg.ahead,
            **meta,
            **pdl_launch(x.device),
        )
    else:
        grid = (triton.cdiv(n_out, cfg.block_n), cfg.split_k, triton.cdiv(m, cfg.block_m))
        k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
        gemv_kernel[grid](
            *pointers,
            sumsq,
            m,
            n_out,
            k,
            k_per_split,
            eps,
            *x.stride(),
            *w.stride(),
            *scale_args,
            PARTIAL=partial,
            BLOCK_M=cfg.block_m,
            **meta,
        )
    if partial:
        split_k_reduce_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
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
