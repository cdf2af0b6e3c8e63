"""Qwen3ForCausalLM (dense): Llama's decoder with an RMSNorm over each head of q and of k before RoPE (one weight of
head_dim each, the same on every TP rank). Its head_dim comes from config.json: not always hidden / heads."""

from __future__ import annotations

import torch

from kernels.gemv import Input
from protocol.config import ModelConfig
from worker.attention import AttentionMetadata
from worker.layers import RMSNorm
from worker.models.llama import LlamaAttention
from worker.models.qwen2 import KVCache, Qwen2ForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__(config, tp_rank, tp_size)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: Input, cos_sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden)
        qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)  # applied inside the attention kernels
        return self.o_proj(self.attn(q, k, v, positions, cos_sin, kv_cache, meta, qk_norm))


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    attention_cls = Qwen3Attention
