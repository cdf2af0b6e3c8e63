"""Qwen2ForCausalLM over a paged KV cache: a flat batch of tokens from many sequences, TP-sharded. Parameter names are
Hugging Face's, with q/k/v packed into qkv_proj and gate/up into gate_up_proj."""

from __future__ import annotations

import torch
from torch import nn

from kernels.gemv import Input
from protocol.config import ModelConfig, check_tp_size
from worker.attention import Attention, AttentionMetadata
from worker.layers import (
    FusedRMSNorm,
    GateUpSwiGLU,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)

KVCache = tuple[torch.Tensor, torch.Tensor]


class Qwen2Attention(nn.Module):
    qkv_bias = True

    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(config, tp_rank, tp_size, self.qkv_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config, tp_rank, tp_size)
        self.attn = Attention(config.head_dim)

    def forward(
        self, positions: torch.Tensor, hidden: Input, cos_sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden)
        return self.o_proj(self.attn(q, k, v, positions, cos_sin, kv_cache, meta))


class Qwen2MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.gate_up_proj = GateUpSwiGLU(config, tp_rank, tp_size)
        self.down_proj = RowParallelLinear(config.intermediate_size, config, tp_rank, tp_size)

    def forward(self, hidden: Input) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(hidden))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int, attention_cls: type[nn.Module]) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, tp_rank, tp_size)
        self.mlp = Qwen2MLP(config, tp_rank, tp_size)
        self.input_layernorm = FusedRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = FusedRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, cos_sin, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen2Model(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int, attention_cls: type[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        self.layers = nn.ModuleList(
            Qwen2DecoderLayer(config, tp_rank, tp_size, attention_cls) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        input_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_rows: the step's tokens are input_ids[input_rows] (a decode step's, by mirror row)."""
        hidden, residual = self.embed_tokens(input_ids, input_rows), None
        # Fewer caches than layers run the first layers alone: a graph's warm-up (worker/cuda_graphs.py).
        for layer, kv_cache in zip(self.layers[: len(kv_caches)], kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, self.rotary.cos_sin, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen2ForCausalLM(nn.Module):
    """forward: Qwen2Model's (-> hidden[T, H]); compute_logits -> [N, V]. Families with this decoder and another
    attention (worker/models/llama.py, qwen3.py) set attention_cls."""

    attention_cls: type[nn.Module] = Qwen2Attention

    def __init__(self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        check_tp_size(config, tp_size)
        self.config = config
        self.model = Qwen2Model(config, tp_rank, tp_size, self.attention_cls)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        if config.tie_word_embeddings:
            # One Parameter object: named_parameters() then lists only model.embed_tokens.weight.
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, *inputs: object) -> torch.Tensor:
        return self.model(*inputs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
