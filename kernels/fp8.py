"""FP8 weights: e4m3 values with one float32 scale per block of the weight (w = value * scale), quantized per
output channel at load (PER_CHANNEL: a row by all of K) or read from a block-quantized checkpoint (Qwen's
[128, 128]). Few rows: the Triton GEMV reads e4m3 and scales in registers (the tile helpers below, used by
kernels/gemv.py); many rows: `scaled_mm_linear` or a dequantized weight (kernels/linear.py picks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

if TYPE_CHECKING:
    from kernels.gemv import GemvConfig

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12  # an all-zero block gets a tiny scale, not a division by zero
PER_CHANNEL = (1, 0)  # (rows, columns) of a scale's block; 0: the whole dim
# GEMV tiles (kernels/gemv.py's candidates). An e4m3 tile is half a bf16 one's bytes, so the one-row tiles load 2-3
# ahead (the 6th field) and some cap registers (the 5th) for more programs per SM: a latency-bound stream needs at
# least as many weight bytes in flight per SM as bf16's best tiles keep.
_DOT_TILES = ((64, 128, 4, 2), (32, 256, 4, 2), (128, 128, 8, 2), (64, 256, 4, 2))
_ONE_ROW_TILES = (
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
_BLOCK_DOT_TILES = ((64, 128, 4, 2), (32, 128, 4, 2), (128, 128, 8, 2))
_BLOCK_ONE_ROW_TILES = (
    (16, 128, 4, 8, 0, 2),
    (32, 128, 8, 0, 0, 2),
    (32, 128, 8, 8, 0),
    (64, 128, 8, 0, 0),
    (32, 128, 4, 8, 0, 2),
)


@dataclass(frozen=True, slots=True)
class Fp8Weight:
    """An e4m3 weight [N, K] and its float32 scales [ceil(N / block[0]), ceil(K / block[1])] ([N, 1] for
    PER_CHANNEL): what kernels.linear takes in place of a weight tensor."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    shape = property(lambda self: self.weight.shape)
    device = property(lambda self: self.weight.device)

    def clone(self) -> Fp8Weight:
        return Fp8Weight(self.weight.clone(), self.scale.clone(), self.block)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """value * scale in float32, then in dtype: what every kernel computes, up to its sums' order."""
        rows, cols = (b or n for b, n in zip(self.block, self.shape))
        scale = self.scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[: self.shape[0], : self.shape[1]]
        return (self.weight.float() * scale).to(dtype)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:  # block 0: one for the dim
    return tuple(-(-n // b) if b else 1 for n, b in zip(shape, block))


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scales) of w [N, K]: each block's amax / 448, its values w / scale rounded to e4m3."""
    (n, k), (rows, cols) = w.shape, (b or d for b, d in zip(block, w.shape))
    blocks = F.pad(w.float(), (0, -k % cols, 0, -n % rows)).unflatten(1, (-1, cols)).unflatten(0, (-1, rows))
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX) / FP8_MAX
    values = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values.flatten(2).flatten(0, 1)[:n, :k].contiguous(), scale


def scaled_mm_supported(x: torch.Tensor, w: Fp8Weight) -> bool:
    """Row-wise scaled FP8 GEMMs (torch._scaled_mm): per-channel scales, bfloat16, sm_89 or later, N and K
    multiples of 16."""
    return (
        x.is_cuda
        and w.block == PER_CHANNEL
        and x.dtype == torch.bfloat16
        and w.shape[0] % 16 == 0
        and w.shape[1] % 16 == 0
        and torch.cuda.get_device_capability(x.device) >= (8, 9)
    )


def scaled_mm_linear(
    x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None, fast_accum: bool = False
) -> torch.Tensor:
    """x @ w^T + bias on FP8 tensor cores, w per output channel and x per row (its amax / 448); fast_accum: cuBLAS's
    fast (less exact) FP8 sums."""
    x8, x_scale = quantize_rows(x)
    return torch._scaled_mm(
        x8,
        w.weight.t(),
        scale_a=x_scale,
        scale_b=w.scale.view(1, -1),
        bias=bias,
        out_dtype=x.dtype,
        use_fast_accum=fast_accum,
    )


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 x, float32 scales [M, 1]): each row of x [M, K] by its own amax / 448."""
    m, k = x.shape
    out = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)  # a row in one load: a loop over K waits on memory once a chunk
    _quantize_rows_kernel[(m,)](
        x,
        out,
        scale,
        k,
        x.stride(0),
        x.stride(1),
        MIN_AMAX,
        FP8_MAX,
        BLOCK=block,
        num_warps=min(16, max(4, block // 1024)),
    )
    return out, scale


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, K, stride_xm, stride_xk, min_amax, fp8_max, BLOCK: tl.constexpr):
    row, offs = tl.program_id(0), tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_xm + offs * stride_xk, mask=offs < K, other=0.0).to(tl.float32)
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), min_amax), fp8_max)  # IEEE division: as the CPU's
    tl.store(scale_ptr + row, scale)
    x = tl.clamp(tl.div_rn(x, scale), -fp8_max, fp8_max)
    tl.store(out_ptr + row * K + offs, x.to(out_ptr.dtype.element_ty), mask=offs < K)


def fp8_tiles(block: tuple[int, int]) -> tuple[list[tuple], list[tuple]]:
    """(dot tiles, one-row tiles) of the GEMV worth timing for FP8 weights with scales of this block."""
    if not block[1]:
        return list(_DOT_TILES), list(_ONE_ROW_TILES)
    clip = lambda tiles: [(n, min(k, block[1]), *rest) for n, k, *rest in tiles]  # noqa: E731
    return clip(_BLOCK_DOT_TILES), clip(_BLOCK_ONE_ROW_TILES)


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


@triton.jit
def fp8_scales(
    scale_ptr,
    offs_n,
    k0,
    N,
    stride_sn,
    stride_sk,
    SWIGLU: tl.constexpr,
    SCALE: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
):
    # The scales of rows offs_n (and of the up rows, offs_n + N) at column k0; zeros without SCALE (unread).
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
def fp8_dot(x, w, s, x_ptr, SCALE: tl.constexpr):
    # x @ w for a [BLOCK_K, BLOCK_N] tile; an e4m3 one in the activations' dtype, times its block scales (per-row
    # scales go on the sums).
    if SCALE:
        w = w.to(x_ptr.dtype.element_ty)
    prod = tl.dot(x.to(w.dtype), w)
    if SCALE == 2:
        prod = prod * s[None, :]
    return prod


@triton.jit
def fp8_to_f32(w, s, SCALE: tl.constexpr):
    # A [BLOCK_N, BLOCK_K] tile in float32 from int32 words of four e4m3, times its block scales (per-row: on the sums).
    if SCALE:
        w = tl.join(tl.join(w, w >> 16), tl.join(w >> 8, w >> 24)).to(tl.int8).to(tl.float8e4nv, bitcast=True)
        w = tl.reshape(w, [w.shape[0], w.shape[1] * 4])
    w = w.to(tl.float32)
    if SCALE == 2:
        w = w * s[:, None]
    return w


@triton.jit
def fp8_row_sums(products, s, SCALE: tl.constexpr):
    sums = tl.sum(products, axis=1)
    if SCALE == 1:
        sums = sums * s
    return sums


@triton.jit
def shift_tiles(w2, w2_up, s2, s2_up, w3, w3_up, s3, s3_up, w_next, w_up_next, s_next, s_up_next, AHEAD: tl.constexpr):
    # The GEMV's (tile to multiply next, the one after it, the one after that): AHEAD 1 leaves the last two unread.
    if AHEAD == 1:
        return w_next, w_up_next, s_next, s_up_next, w2, w2_up, s2, s2_up, w3, w3_up, s3, s3_up
    if AHEAD == 2:
        return w2, w2_up, s2, s2_up, w_next, w_up_next, s_next, s_up_next, w3, w3_up, s3, s3_up
    return w2, w2_up, s2, s2_up, w3, w3_up, s3, s3_up, w_next, w_up_next, s_next, s_up_next
