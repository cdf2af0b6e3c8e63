"""FP8 weights: e4m3 values with one float32 scale per block of the weight (w = value * scale), quantized per
output channel at load (PER_CHANNEL: a row by all of K) or read from a block-quantized checkpoint (Qwen's
[128, 128]). Few rows: the Triton GEMV reads e4m3 and scales in registers (kernels/gemv.py); many rows:
`scaled_mm_linear` or a dequantized weight (worker/linear.py picks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12  # an all-zero block gets a tiny scale, not a division by zero
PER_CHANNEL = (1, 0)  # (rows, columns) of a scale's block; 0: the whole dim


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
    """Row-wise scaled FP8 GEMMs (torch._scaled_mm): per-channel scales, bfloat16, sm_89+, N and K multiples of 16."""
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
    """x @ w^T + bias on FP8 tensor cores, w per output channel, x per row; fast_accum: cuBLAS's less exact sums."""
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
        *x.stride(),
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
