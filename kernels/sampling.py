"""Gumbel-max sampling with hashed noise: argmax(logits / temperature + Gumbel(seed, position, token)), an exact
draw from softmax(logits / temperature); plain argmax where temperature <= 0.

The noise is a hash of (row seed, position of the sampled token, vocab index), so a request draws the same tokens
alone or in any batch, and after a preemption: splitmix64 of (seed, position) is the row's key, lowbias32 of the
key and the index each token's bits (32-bit: the per-token hash is most of the kernel's work)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda.libdevice import fast_logf

from kernels.arrivals import arrival_counters, last_to_arrive
from kernels.gemv import num_sms

# splitmix64's and lowbias32's constants; tl.constexpr so that the kernel may read them as globals.
GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
MIX1 = tl.constexpr(0xBF58476D1CE4E5B9)
MIX2 = tl.constexpr(0x94D049BB133111EB)
GOLDEN32 = tl.constexpr(0x9E3779B9)
MIX32_1 = tl.constexpr(0x7FEB352D)
MIX32_2 = tl.constexpr(0x846CA68B)
_LOW32 = 0xFFFFFFFF
_FAST_LOG = os.environ.get("TRITON_INTERPRET") != "1"  # read at import, as triton.jit reads it
_MAX_CHUNKS = 128  # the chunks of a row one program combines: a constexpr, one compiled kernel for every batch
_BLOCK = 512


def _i64(c: tl.constexpr) -> int:
    """An unsigned 64-bit constant as the signed int64 of the same bits."""
    c = int(c.value)
    return c - (1 << 64) if c >= 1 << 63 else c


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def uniform_from_bits(top_bits: torch.Tensor) -> torch.Tensor:
    """23 random bits -> (j + 0.5) / 2**23, exact in float32, never 0 or 1 (24 bits could round to 1.0: +inf noise)."""
    return (top_bits.to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def hashed_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """u[n, v] in (0, 1), a pure function of (seeds[n], positions[n], v) for v < vocab: the kernel's hash."""
    z = seeds * _i64(GOLDEN) + positions  # splitmix64: int64 products wrap as the uint64 ones
    for shift, mix in ((30, MIX1), (27, MIX2)):
        z = (z ^ _srl(z, shift)) * _i64(mix)
    z = z ^ _srl(z, 31)
    vocab_keys = torch.arange(vocab, dtype=torch.int64, device=seeds.device) * int(GOLDEN32.value)
    x = (((z ^ _srl(z, 32)) & _LOW32)[:, None] + vocab_keys[None, :]) & _LOW32  # lowbias32 of key + index
    for shift, mix in ((16, MIX32_1), (15, MIX32_2)):
        x = ((x ^ (x >> shift)) * int(mix.value)) & _LOW32
    return uniform_from_bits((x ^ (x >> 16)) >> 9)


def gumbel_argmax_ref(
    logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
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
def _mix32(x):
    x = (x ^ (x >> 16)) * MIX32_1
    x = (x ^ (x >> 15)) * MIX32_2
    return x ^ (x >> 16)


@triton.jit
def _log(x, FAST_LOG: tl.constexpr):
    # libdevice's logf was most of this kernel's instructions; lg2.approx's relative error (~2^-22) moves a draw only
    # between scores that close. The interpreter has no libdevice.
    if FAST_LOG:
        return fast_logf(x)
    return tl.log(x)


# chunk_len varies with the batch size: specialising on it would compile a kernel mid-serving for new sizes.
@triton.jit(do_not_specialize=["chunk_len"])
def _gumbel_argmax_kernel(
    logits_ptr,
    stride,
    rows_ptr,
    temps_ptr,
    stride_temp,
    seeds_ptr,
    stride_seed,
    pos_ptr,
    best_val_ptr,
    best_idx_ptr,
    arrivals,
    out_ptr,
    last_token_ptr,
    vocab,
    chunk_len,
    BLOCK: tl.constexpr,
    MAX_CHUNKS: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    STORE_LAST: tl.constexpr,
    FAST_LOG: tl.constexpr,
):
    # Program (n, chunk) scans chunk_len columns of row n; the last of row n's chunks to arrive picks its token from
    # the chunks' maxima. A column's score depends only on its (row, column): the same result for any chunking.
    n = tl.program_id(0).to(tl.int64)
    chunk, chunks = tl.program_id(1), tl.num_programs(1)
    row = n
    if HAS_ROWS:
        row = tl.load(rows_ptr + n).to(tl.int64)
    temp = tl.load(temps_ptr + row * stride_temp)
    inv_temp = tl.math.div_rn(1.0, temp)  # rounded as the reference's 1 / temp
    seed = tl.load(seeds_ptr + row * stride_seed).to(tl.uint64, bitcast=True)
    pos = tl.load(pos_ptr + n).to(tl.uint64, bitcast=True)
    row_key = _mix64(seed * GOLDEN + pos)
    row_key = (row_key ^ (row_key >> 32)).to(tl.uint32)
    best_val = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK,), tl.int32)
    for start in range(chunk * chunk_len, chunk * chunk_len + chunk_len, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        score = tl.load(logits_ptr + n * stride + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        if temp > 0:  # a greedy row skips the hash
            z = _mix32(row_key + cols.to(tl.uint32) * GOLDEN32)
            u = ((z >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # as uniform_from_bits
            # -log(u) accurate relative to its size also near u = 1 (the likely winner), where the fast log's
            # absolute error would dominate: there -log(1 - t) = t + t^2/2 + t^3/3 to float32 precision.
            t = 1.0 - u
            neg_log_u = tl.where(t < 0.0078125, t * (1.0 + t * (0.5 + t * 0.33333334)), -_log(u, FAST_LOG))
            score = score * inv_temp - _log(neg_log_u, FAST_LOG)
        better = score > best_val  # strict: of equal scores the earlier column stays
        best_val = tl.where(better, score, best_val)
        best_idx = tl.where(better, cols, best_idx)
    val = tl.max(best_val, axis=0)
    tl.store(best_val_ptr + n * chunks + chunk, val)
    tl.store(best_idx_ptr + n * chunks + chunk, tl.min(tl.where(best_val == val, best_idx, vocab), axis=0))
    if last_to_arrive(arrivals + n, chunks):
        # The first column of the row's maximum (chunks hold ascending columns).
        offs = tl.arange(0, MAX_CHUNKS)
        vals = tl.load(best_val_ptr + n * chunks + offs, mask=offs < chunks, other=float("-inf"), cache_modifier=".cg")
        idxs = tl.load(best_idx_ptr + n * chunks + offs, mask=offs < chunks, other=vocab, cache_modifier=".cg")
        token = tl.min(tl.where(vals == tl.max(vals, axis=0), idxs, vocab), axis=0).to(tl.int64)
        tl.store(out_ptr + n, token)
        if STORE_LAST:
            tl.store(last_token_ptr + row, token)


def gumbel_argmax_triton(
    logits: torch.Tensor,
    temps: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor | None = None,
    last_token: torch.Tensor | None = None,
) -> torch.Tensor:
    if logits.stride(-1) != 1:
        raise ValueError(f"gumbel_argmax needs a unit stride on the vocab dim, got {logits.stride()}")
    n, vocab, block = *logits.shape, _BLOCK
    # Compute-bound: programs enough to fill the GPU at batch 1, and at least 8 chunks a row at any batch.
    chunks = min(triton.cdiv(vocab, 4 * block), max(8, triton.cdiv(2 * num_sms(logits.device), n)), _MAX_CHUNKS)
    chunk = triton.cdiv(triton.cdiv(vocab, chunks), block) * block
    chunks = triton.cdiv(vocab, chunk)
    best_val = torch.empty((n, chunks), dtype=torch.float32, device=logits.device)
    best_idx = torch.empty((n, chunks), dtype=torch.int32, device=logits.device)
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    _gumbel_argmax_kernel[(n, chunks)](
        logits,
        logits.stride(0),
        positions if rows is None else rows,
        temps,
        temps.stride(0),
        seeds,
        seeds.stride(0),
        positions,
        best_val,
        best_idx,
        arrival_counters(logits.device, n, "gumbel_argmax"),
        out,
        out if last_token is None else last_token,
        vocab,
        chunk,
        BLOCK=block,
        MAX_CHUNKS=_MAX_CHUNKS,
        HAS_ROWS=rows is not None,
        STORE_LAST=last_token is not None,
        num_warps=8,
        FAST_LOG=_FAST_LOG,
    )
    return out


def gumbel_argmax(
    logits: torch.Tensor,
    temps: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor | None = None,
    last_token: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token ids [N]: argmax(logits[n] / temp + hashed Gumbel noise) per row n, plain argmax where temp <= 0, with
    temp and seed temps[n] and seeds[n], or temps[rows[n]] and seeds[rows[n]] given rows (the sampler's per-row
    tables). With last_token (and rows), row n's token is also stored at last_token[rows[n]]."""
    if last_token is not None and rows is None:
        raise ValueError("gumbel_argmax stores into last_token[rows[n]]: pass rows with last_token")
    if logits.is_cuda:
        return gumbel_argmax_triton(logits, temps, seeds, positions, rows, last_token)
    if rows is not None:
        temps, seeds = temps[rows], seeds[rows]
    out = gumbel_argmax_ref(logits, temps, seeds, positions)
    if last_token is not None:
        last_token[rows] = out
    return out


@triton.jit
def _token_bitmask_kernel(logits_ptr, stride, lanes_ptr, mask_ptr, words, vocab, BLOCK: tl.constexpr):
    # Program (i, c) masks BLOCK ids of row i by mask row lanes[i] (-1: none); it stores only the banned ones.
    i, offs = tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = tl.load(lanes_ptr + i)
    if m >= 0:
        bits = tl.load(mask_ptr + m.to(tl.int64) * words + offs // 32, mask=offs < vocab, other=-1)
        banned = ((bits >> (offs % 32)) & 1) == 0
        tl.store(logits_ptr + i.to(tl.int64) * stride + offs, float("-inf"), mask=banned & (offs < vocab))


def token_bitmask_triton(logits: torch.Tensor, lanes: torch.Tensor, bitmask: torch.Tensor) -> None:
    vocab = min(logits.shape[1], 32 * bitmask.shape[1])
    _token_bitmask_kernel[(logits.shape[0], triton.cdiv(vocab, 4096))](
        logits, logits.stride(0), lanes, bitmask, bitmask.shape[1], vocab, BLOCK=4096, num_warps=4
    )


def apply_token_bitmask_(logits: torch.Tensor, lanes: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf in each row i of logits with lanes[i] >= 0 wherever bit t (of int32 word t // 32, xgrammar's
    packing) of bitmask[lanes[i]] is 0."""
    if logits.is_cuda:
        return token_bitmask_triton(logits, lanes, bitmask)
    rows = torch.nonzero(lanes[: logits.shape[0]] >= 0).flatten()
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask[lanes[rows].long()][:, :, None] >> shifts) & 1
    logits[rows] = logits[rows].masked_fill(~bits.view(len(rows), -1)[:, : logits.shape[1]].bool(), float("-inf"))
