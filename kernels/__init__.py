"""Kernels: each public function runs Triton on CUDA tensors and its plain torch reference otherwise."""

from kernels.activation import silu_and_mul
from kernels.decode_attention import NewTokenKV, rope_store_decode_attention
from kernels.embedding import embed_rows
from kernels.kv_store import make_cos_sin, rope_store_kv
from kernels.norm import add_rms_norm, qk_rms_norm, rms_norm
from kernels.prefill_attention import paged_prefill_attention
from kernels.sampling import apply_token_bitmask_, gumbel_argmax

__all__ = [
    "NewTokenKV",
    "add_rms_norm",
    "apply_token_bitmask_",
    "embed_rows",
    "gumbel_argmax",
    "make_cos_sin",
    "paged_prefill_attention",
    "qk_rms_norm",
    "rms_norm",
    "rope_store_decode_attention",
    "rope_store_kv",
    "silu_and_mul",
]
