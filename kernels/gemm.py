"""gate_up of a decode batch of many rows (17-256) with SwiGLU in the GEMM's epilogue: no [M, 2I] output written
and read back, no SwiGLU launch.

Each program owns a BLOCK_M x BLOCK_N tile of the output and sums both its gate rows n and its up rows N + n over
K, loading x's and the weight's tiles by TMA (Hopper's copy engine: a host tensor descriptor, out-of-range rows
and columns read as zeros), then stores silu(gate) * up rounded as linear() then silu_and_mul() round. Measured
alone on an H200 at Qwen2.5-1.5B's gate_up (bench/NOTES.md, probe 55): 17.7 / 20.7 / 26.9 µs at 64 / 128 / 192
rows against cuBLAS + silu_and_mul's 19.5 / 22.0 / 28.3, but 32.2 against 26.0 at 256, so kernels/linear.py
times it against the unfused path per rows bucket and runs it only where it won.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

GEMM_MAX_M = 256  # decode batches up to max_num_seqs' default; prompt steps keep cuBLAS
_GROUP_M = 8


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_stages: int = 4
    num_warps: int = 4


# Probe 55's best tiles at 64-192 rows: the same tile with three or four stages in flight.
_CANDIDATES = (GemmConfig(num_stages=3), GemmConfig(num_stages=4))


@triton.jit
def _swiglu_gemm_kernel(x_desc, w_desc, out_ptr, M, N, K, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # Programs walk the output in groups of GROUP_M row tiles, so the programs running together share weight tiles.
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = pid // per_group * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + pid % per_group % group_m
    pid_n = pid % per_group // group_m
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        x = x_desc.load([pid_m * BLOCK_M, k])
        gate = tl.dot(x, w_desc.load([pid_n * BLOCK_N, k]).T, gate)
        up = tl.dot(x, w_desc.load([N + pid_n * BLOCK_N, k]).T, up)
    dtype = out_ptr.dtype.element_ty
    g = gate.to(dtype).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # silu_and_mul's roundings
    out = (act * up.to(dtype).to(tl.float32)).to(dtype)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], out,
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def candidate_configs(x: torch.Tensor, w: torch.Tensor) -> list[GemmConfig]:
    """The tiles worth timing for x @ [gate | up]^T, or none where the kernel cannot run: TMA needs a Hopper or
    newer GPU and 16-byte aligned rows and bases; more than GEMM_MAX_M rows stay on cuBLAS."""
    if not (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9 and x.shape[0] <= GEMM_MAX_M):
        return []
    return list(_CANDIDATES) if all(_tma_ready(t) for t in (x, w)) else []


def _tma_ready(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def swiglu_gemm_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                       config: GemmConfig = GemmConfig()) -> torch.Tensor:
    """silu_and_mul(x @ w^T) for w = [gate | up] ([2I, K]) in one kernel; x[M, K] with unit column stride."""
    if bias is not None:
        raise ValueError("swiglu_gemm_triton takes no bias (Qwen2's MLP has none): run swiglu_linear_ref for a "
                         "biased gate_up")
    (n2, k), m = w.shape, x.shape[0]
    if x.shape[1] != k or n2 % 2:
        raise ValueError(f"x[{m}, {x.shape[1]}] and w{list(w.shape)}: pass x[M, K] and w = [gate | up] of shape "
                         f"[2I, K]")
    n = n2 // 2
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    c = config
    grid = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n),)
    _swiglu_gemm_kernel[grid](TensorDescriptor.from_tensor(x, [c.block_m, c.block_k]),
                              TensorDescriptor.from_tensor(w, [c.block_n, c.block_k]), out, m, n, k, out.stride(0),
                              BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=_GROUP_M,
                              num_stages=c.num_stages, num_warps=c.num_warps)
    return out
