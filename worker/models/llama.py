"""LlamaForCausalLM (Llama 3.x): Qwen2's decoder (worker/models/qwen2.py) without a bias on q, k and v. What else sets
Llama 3 apart lives outside the layer: its RoPE scaling is in the table the attention kernels read
(ModelConfig.rope_scaling, kernels/kv_store.make_cos_sin), and its BOS token comes from the tokenizer."""

from __future__ import annotations

from worker.models.qwen2 import Qwen2Attention, Qwen2ForCausalLM


class LlamaAttention(Qwen2Attention):
    qkv_bias = False


class LlamaForCausalLM(Qwen2ForCausalLM):
    attention_cls = LlamaAttention
