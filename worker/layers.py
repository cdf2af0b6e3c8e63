"""Tensor-parallel building blocks of a decoder: packed linears, vocab-parallel embedding and lm_head, RMSNorm, RoPE.
Every parameter carries weight_loader(param, loaded, shard_id=None), which checks the full checkpoint tensor's shape
and copies this rank's shard into place (an FP8 scale's shard is its weight's, in whole blocks)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels import add_rms_norm, embed_rows, make_cos_sin, rms_norm
from kernels.fp8 import FP8, PER_CHANNEL, Fp8Weight, scale_shape
from kernels.gemv import Input, NormedInput, Weight
from protocol.config import ModelConfig
from worker.linear import linear
from worker.parallel import all_gather_last_dim, all_reduce, local_kv_heads


def fp8_block(config: ModelConfig) -> tuple[int, int] | None:
    """The block of one FP8 scale (rows, columns; 0: the whole dim) of every linear, None without FP8."""
    if config.quantization is None:
        return None
    return tuple(config.weight_block_size) if config.weight_block_size else PER_CHANNEL


def _param(*shape: int, loader: Callable, shard_ids: tuple = (None,), dtype: torch.dtype | None = None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader
    p.shard_ids = shard_ids  # the loader checks that every one of them was loaded
    return p


def _linear_weight(
    module: nn.Module, out: int, in_: int, loader: Callable, config: ModelConfig, shard_ids: tuple = (None,)
) -> None:
    """module.weight [out, in_] in the default dtype, or e4m3 beside module.weight_scale (one float32 per block)."""
    block = module.fp8_block = fp8_block(config)
    module.weight = _param(out, in_, loader=loader, shard_ids=shard_ids, dtype=FP8 if block else None)
    if block:
        module.weight_scale = _param(
            *scale_shape((out, in_), block), loader=loader, shard_ids=shard_ids, dtype=torch.float32
        )
        module.weight_scale.block = block


def _weight(module: nn.Module) -> Weight:
    return Fp8Weight(module.weight, module.weight_scale, module.fp8_block) if module.fp8_block else module.weight


def _check_shape(param: nn.Parameter, loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    """loaded must be `expected` (the full weight's shape), or for a scale that shape in blocks."""
    if hasattr(param, "block"):
        expected = scale_shape(expected, param.block)
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(
            f"checkpoint shape {tuple(loaded.shape)} does not match the model's {tuple(expected)}: "
            "use the config.json that came with these weights"
        )


def _load_slice(
    param: torch.Tensor, dst_start: int, loaded: torch.Tensor, src_start: int, size: int, dim: int = 0
) -> None:
    """Copy loaded[src_start : src_start + size] (along dim) into param at dst_start; for a scale these are the
    weight's rows or columns, taken in whole blocks (a per-channel scale's one column: all of it)."""
    if hasattr(param, "block"):
        b = param.block[dim]
        if b and (dst_start % b or src_start % b):
            raise ValueError(
                f"a shard of FP8 scale blocks of {b} starts at {src_start} (packed at {dst_start}), "
                f"inside a block: use a tensor_parallel_size whose shards are multiples of {b}"
            )
        dst_start, src_start, size = (dst_start // b, src_start // b, -(-size // b)) if b else (0, 0, 1)
    param.data.narrow(dim, dst_start, size).copy_(loaded.narrow(dim, src_start, size))


def _load_whole(param: nn.Parameter, loaded: torch.Tensor, shard_id: None = None) -> None:  # replicated: norms
    _check_shape(param, loaded, tuple(param.shape))
    param.data.copy_(loaded)


class QKVParallelLinear(nn.Module):
    """Column-parallel q|k|v projection (with or without bias), this rank's heads packed as [q heads, k heads, v heads];
    returns q [T, heads, D], k and v [T, kv heads, D], views of one output."""

    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int, bias: bool) -> None:
        super().__init__()
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.hidden_size = config.head_dim, config.hidden_size
        self.total = {"q": num_heads, "k": num_kv_heads, "v": num_kv_heads}
        self.num_heads, self.num_kv_heads = num_heads // tp_size, local_kv_heads(num_kv_heads, tp_size)
        # Split KV heads start at rank * kv/tp; a replicated one (tp > kv) is shared by tp/kv neighbouring
        # ranks, whose query heads all map onto it: head rank // (tp/kv), the same floor formula.
        kv_start = tp_rank * num_kv_heads // tp_size
        self.first_head = {"q": tp_rank * self.num_heads, "k": kv_start, "v": kv_start}
        self.offset = {"q": 0, "k": self.num_heads, "v": self.num_heads + self.num_kv_heads}
        out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        _linear_weight(self, out, self.hidden_size, self.weight_loader, config, ("q", "k", "v"))
        self.bias = _param(out, loader=self.weight_loader, shard_ids=("q", "k", "v")) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        d = self.head_dim
        _check_shape(param, loaded, (self.total[shard_id] * d, self.hidden_size)[: param.dim()])  # or the bias
        local = self.num_heads if shard_id == "q" else self.num_kv_heads
        _load_slice(param, self.offset[shard_id] * d, loaded, self.first_head[shard_id] * d, local * d)

    def forward(self, x: Input) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = linear(x, _weight(self), self.bias).unflatten(-1, (-1, self.head_dim))
        return qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=-2)


class GateUpSwiGLU(nn.Module):
    """silu(x @ gate^T) * (x @ up^T), column-parallel, [gate | up] in one weight (shard 0 gate_proj, 1 up_proj):
    SwiGLU runs in the GEMV's stores where that is faster."""

    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.full, self.local, self.tp_rank = config.intermediate_size, config.intermediate_size // tp_size, tp_rank
        self.in_features = config.hidden_size
        _linear_weight(self, 2 * self.local, self.in_features, self.weight_loader, config, (0, 1))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        _check_shape(param, loaded, (self.full, self.in_features))
        _load_slice(param, shard_id * self.local, loaded, self.tp_rank * self.local, self.local)

    def forward(self, x: Input) -> torch.Tensor:
        return linear(x, _weight(self), swiglu=True)


class RowParallelLinear(nn.Module):
    """Row-parallel projection onto the hidden size (no bias): each rank holds a slice of the input dim; sums them."""

    def __init__(self, in_features: int, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.full_in, self.out_features, self.tp_rank, self.tp_size = in_features, config.hidden_size, tp_rank, tp_size
        _linear_weight(self, self.out_features, in_features // tp_size, self.weight_loader, config)
        self.weight.full_in = in_features  # the fan-in that random init scales by

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: None = None) -> None:
        _check_shape(param, loaded, (self.out_features, self.full_in))
        local = self.full_in // self.tp_size
        _load_slice(param, 0, loaded, self.tp_rank * local, local, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(linear(x, _weight(self)), self.tp_size)


class VocabParallelEmbedding(nn.Module):
    """Each rank holds ceil(V / tp) vocab rows (the last rank's tail zero-padded); lookups are summed."""

    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.vocab_size, self.tp_size = vocab_size, tp_size
        self.rows = -(-vocab_size // tp_size)
        self.start = tp_rank * self.rows
        self.weight = _param(self.rows, hidden_size, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: None = None) -> None:
        _check_shape(param, loaded, (self.vocab_size, param.shape[1]))
        n = max(0, min(self.rows, self.vocab_size - self.start))
        param.data[n:].zero_()
        _load_slice(param, 0, loaded, self.start, n)

    def forward(self, ids: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Embeddings of ids, or of ids[rows] (a decode step's last sampled tokens, gathered in the lookup)."""
        if self.tp_size == 1:
            return F.embedding(ids, self.weight) if rows is None else embed_rows(self.weight, ids, rows)
        if rows is not None:
            ids = ids[rows]
        mine = (ids >= self.start) & (ids < self.start + self.rows)
        out = F.embedding((ids - self.start).masked_fill(~mine, 0), self.weight)
        return all_reduce(out.masked_fill(~mine.unsqueeze(-1), 0), self.tp_size)


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-parallel lm_head: each rank computes its vocab slice of the logits; all ranks get all logits."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return all_gather_last_dim(linear(hidden, self.weight), self.tp_size)[:, : self.vocab_size]


class RMSNorm(nn.Module):
    """RMSNorm; given a residual, adds it first and returns (normed, new residual) in one fused kernel."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(hidden_size, loader=_load_whole)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class FusedRMSNorm(RMSNorm):
    """An RMSNorm read by linears only: normed is a NormedInput, which the next linear computes (in its GEMV)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[NormedInput, torch.Tensor]:
        return NormedInput.of(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """The RoPE table cos_sin [max_position, head_dim] (make_cos_sin's) that the attention kernels read, float32."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.shape = (config.max_position_embeddings, config.head_dim, config.rope_theta)
        self.scaling = config.rope_scaling
        self.register_buffer("cos_sin", make_cos_sin(*self.shape, None, self.scaling), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # .to(dtype) casts buffers too: rebuild the table in float32 on its device
        self.cos_sin = make_cos_sin(*self.shape, self.cos_sin.device, self.scaling)
        return self
