"""LlamaForCausalLM (Llama 3.x): Qwen2's decoder without a bias on q, k and v; its RoPE scaling is in the RoPE table
(kernels/kv_store.make_cos_sin), its BOS token comes from the tokenizer."""

from __future__ import annotations

from worker.models.qwen2 import Qwen2Attention, Qwen2ForCausalLM


class LlamaAttention(Qwen2Attention):
    qkv_bias = False


class LlamaForCausalLM(Qwen2ForCausalLM):
    attention_cls = LlamaAttention
