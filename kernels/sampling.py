"""Gumbel-max sampling with hashed noise: argmax(logits / temperature + Gumbel(seed, position, token)).

argmax(logits + Gumbel noise) is an exact draw from softmax(logits). The noise is a counter-based hash
(splitmix64) of (row seed, position of the sampled token, vocab index), so a request draws the same tokens
alone or in any batch, and again after a preemption. A row with temperature <= 0 takes the plain argmax.

The torch reference builds about ten [rows, vocab] int64 temporaries; the Triton kernel reads the logits
once and keeps the hash in registers.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda.libdevice import fast_logf

from kernels.gemv import num_sms

# splitmix64's constants; tl.constexpr so that the Triton kernel may read them as globals.
GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
MIX1 = tl.constexpr(0xBF58476D1CE4E5B9)
MIX2 = tl.constexpr(0x94D049BB133111EB)
_FAST_LOG = os.environ.get("TRITON_INTERPRET") != "1"  # read at import, as triton.jit reads it


def _i64(c: tl.constexpr) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores (same bits)."""
    c = int(c.value)
    return c - (1 << 64) if c >= 1 << 63 else c


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic; the mask drops the sign copies)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64_ref(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer; int64 multiplication wraps, which is the arithmetic it wants."""
    z = (z ^ _srl(z, 30)) * _i64(MIX1)
    z = (z ^ _srl(z, 27)) * _i64(MIX2)
    return z ^ _srl(z, 31)


def uniform_from_bits(top_bits: torch.Tensor) -> torch.Tensor:
    """23 random bits -> (j + 0.5) / 2**23, exact in float32, so never 0 or 1: a 24th bit would make
    (2**24 - 1 + 0.5) round to 2**24, u = 1.0, and that token's Gumbel noise +inf (a draw ignoring the logits)."""
    return (top_bits.to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def hashed_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """u[n, v] in (0, 1), a pure function of (seeds[n], positions[n], v) for v < vocab."""
    row_key = _mix64_ref(seeds * _i64(GOLDEN) + positions)
    vocab_keys = torch.arange(vocab, dtype=torch.int64, device=seeds.device) * _i64(GOLDEN)
    z = _mix64_ref(row_key[:, None] + vocab_keys[None, :])
    return uniform_from_bits(_srl(z, 41))


def gumbel_argmax_ref(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor,
                      positions: torch.Tensor) -> torch.Tensor:
    """Token ids [N] from logits [N, V], temps [N] float32, seeds and positions [N] int64."""
    greedy = logits.argmax(dim=-1)
    temp = temps[:, None]
    scaled = logits.float() * (1.0 / torch.where(temp > 0, temp, torch.ones_like(temp)))  # the kernel's roundings
    u = hashed_uniform(seeds, positions, logits.shape[-1])
    sampled = (scaled - torch.log(-torch.log(u))).argmax(dim=-1)
    return torch.where(temps > 0, sampled, greedy)


@triton.jit
def _mix64(z):
    z = (z ^ (z >> 30)) * MIX1
    z = (z ^ (z >> 27)) * MIX2
    return z ^ (z >> 31)


@triton.jit
def _log(x, FAST_LOG: tl.constexpr):
    # libdevice's logf took most of this kernel's instructions (two a token; batch 256 at 151,936 tokens:
    # 153 µs, compute-bound); lg2.approx's relative error (~2^-22) moves a draw only between scores that
    # close, and cut it to 88 µs with the multiply by 1 / temp. The interpreter has no libdevice.
    if FAST_LOG:
        return fast_logf(x)
    return tl.log(x)


@triton.jit
def _neg_log(u, FAST_LOG: tl.constexpr):
    # -log(u), accurate relative to its size also where u is near 1 (E tiny, the token's noise large: the
    # likely winner) and the GPU's log is an approximation with an absolute error: there 1 - u is exact and
    # -log(1 - t) = t + t^2/2 + t^3/3 to float32 precision for t < 2^-7.
    t = 1.0 - u
    return tl.where(t < 0.0078125, t * (1.0 + t * (0.5 + t * 0.33333334)), -_log(u, FAST_LOG))


# chunk_len varies with the batch size: specialising on it (a constexpr, or an int Triton marks as divisible
# by 16) compiled a new kernel for many batch sizes, a ~0.5 s stall in the middle of serving each time.
@triton.jit(do_not_specialize=["chunk_len"])
def _gumbel_argmax_kernel(logits_ptr, stride, temps_ptr, seeds_ptr, pos_ptr, best_val_ptr, best_idx_ptr,
                          vocab, chunk_len, BLOCK: tl.constexpr, FAST_LOG: tl.constexpr):
    # Program (row, chunk) scans chunk_len columns of one row; the host reduces the chunks' maxima. Every
    # column's score depends only on its own (row, column), so the result is the same for any chunking or batch.
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temp = tl.load(temps_ptr + row)
    inv_temp = tl.math.div_rn(1.0, temp)  # rounded as the reference's 1 / temp
    seed = tl.load(seeds_ptr + row).to(tl.uint64, bitcast=True)
    pos = tl.load(pos_ptr + row).to(tl.uint64, bitcast=True)
    row_key = _mix64(seed * GOLDEN + pos)
    best_val = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK,), tl.int32)
    for start in range(chunk * chunk_len, chunk * chunk_len + chunk_len, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab
        score = tl.load(logits_ptr + row * stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if temp > 0:  # a greedy row (a decode graph draws every row here) skips the hash: a plain argmax
            z = _mix64(row_key + cols.to(tl.uint64) * GOLDEN)
            u = ((z >> 41).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # as uniform_from_bits
            score = score * inv_temp - _log(_neg_log(u, FAST_LOG), FAST_LOG)
        better = score > best_val  # strict: of equal scores the earlier column stays
        best_val = tl.where(better, score, best_val)
        best_idx = tl.where(better, cols, best_idx)
    val = tl.max(best_val, axis=0)
    idx = tl.min(tl.where(best_val == val, best_idx, vocab), axis=0)
    tl.store(best_val_ptr + row * tl.num_programs(1) + chunk, val)
    tl.store(best_idx_ptr + row * tl.num_programs(1) + chunk, idx)


def gumbel_argmax_triton(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor,
                         positions: torch.Tensor, block: int = 512, chunks: int | None = None) -> torch.Tensor:
    if logits.stride(-1) != 1:
        raise ValueError(f"gumbel_argmax needs a unit stride on the vocab dim, got {logits.stride()}")
    rows, vocab = logits.shape
    if chunks is None:
        # The 64-bit hash makes this compute-bound: programs enough to fill the card at batch 1, and at least
        # 8 chunks a row at any batch (H200, 151,936 tokens: batch 256 from 181 µs with 2 chunks of 1,024-wide
        # blocks and 4 warps to 153 µs with 8 of 512 and 8 warps; batch 1 11.7 -> 8.6 µs).
        chunks = max(1, min(triton.cdiv(vocab, 4 * block), max(8, triton.cdiv(2 * num_sms(logits.device), rows))))
    chunk = triton.cdiv(triton.cdiv(vocab, chunks), block) * block
    chunks = triton.cdiv(vocab, chunk)
    best_val = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    best_idx = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    _gumbel_argmax_kernel[(rows, chunks)](logits, logits.stride(0), temps, seeds, positions, best_val, best_idx,
                                          vocab, chunk, BLOCK=block, num_warps=8,
                                          FAST_LOG=_FAST_LOG)
    # argmax returns the first of equal maxima: the earliest chunk, whose column is the earliest.
    return best_idx.gather(1, best_val.argmax(dim=1, keepdim=True)).squeeze(1).long()


def gumbel_argmax(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """Token ids [N]: argmax(logits / temps + hashed Gumbel noise) per row, plain argmax where temps <= 0."""
    if logits.is_cuda:
        return gumbel_argmax_triton(logits, temps, seeds, positions)
    return gumbel_argmax_ref(logits, temps, seeds, positions)
