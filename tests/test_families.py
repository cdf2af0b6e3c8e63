"""What Qwen3 and Llama 3 add to Qwen2's decoder, each against Hugging Face: the per-head q/k RMSNorm (its Triton
kernel under TRITON_INTERPRET on CPU), the llama3-scaled RoPE table, and the registry of architectures."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_store import make_cos_sin
from kernels.norm import qk_rms_norm_ref, qk_rms_norm_triton
from protocol.config import ARCHITECTURES
from worker.models import MODELS, model_class

LLAMA32_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "head_dim,theta,scaling,max_pos",
    [
        (64, 500000.0, LLAMA32_SCALING, 131072),  # Llama 3.2 1B's published values
        (24, 10000.0, {**LLAMA32_SCALING, "factor": 8.0, "original_max_position_embeddings": 64}, 256),
    ],
)
def test_llama3_scaled_cos_sin_equals_hugging_face_rotary_embedding(head_dim, theta, scaling, max_pos):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=dict(scaling),
        max_position_embeddings=max_pos,
    )
    pos = torch.tensor([0, 1, 7, 63, 100, max_pos // 2, max_pos - 1])
    cos, sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), pos[None])
    table = make_cos_sin(max_pos, head_dim, theta, "cpu", scaling)[pos]
    half = head_dim // 2
    torch.testing.assert_close(table[:, :half], cos[0, :, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(table[:, half:], sin[0, :, :half], atol=1e-6, rtol=0)
    unscaled = make_cos_sin(max_pos, head_dim, theta, "cpu")[pos]
    assert not torch.allclose(table, unscaled)  # the scaling changed the low frequencies


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (6, 1, 24), (16, 8, 128)])
def test_qk_rms_norm_triton_matches_reference_in_place_on_qkv_views(hq, hkv, d):
    qkv = torch.randn(5, (hq + 2 * hkv) * d) * 3
    q, k, v = (t.view(5, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    qw, kw = torch.rand(d) + 0.5, torch.rand(d) + 0.5
    expected = qkv.clone()
    eq, ek, _ = (t.view(5, -1, d) for t in expected.split([hq * d, hkv * d, hkv * d], dim=-1))
    qk_rms_norm_ref(eq, ek, qw, kw, 1e-6)
    v_before = v.clone()
    qk_rms_norm_triton(q, k, qw, kw, 1e-6)
    torch.testing.assert_close(qkv, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(v, v_before)  # v is not a head of q or k


def test_qk_rms_norm_reference_equals_hugging_face_qwen3_rms_norm():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(32) + 0.5)
    q, k = torch.randn(3, 4, 32).bfloat16(), torch.randn(3, 2, 32).bfloat16()
    norm = norm.bfloat16()
    expected_q, expected_k = norm(q), norm(k)
    qk_rms_norm_ref(q, k, norm.weight, norm.weight, 1e-6)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


def test_every_resolvable_architecture_has_a_model_class_and_others_are_refused():
    assert tuple(MODELS) == ARCHITECTURES
    assert [model_class(a).__name__ for a in ARCHITECTURES] == list(ARCHITECTURES)
    with pytest.raises(ValueError, match="'MistralForCausalLM'.*Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM"):
        model_class("MistralForCausalLM")


def test_only_qwen2_has_a_qkv_bias_and_only_qwen3_has_q_k_norms(tmp_path):
    from checkpoints import make_checkpoint
    from test_model import build_model

    for family, bias, norms in (("qwen2", True, False), ("qwen3", False, True), ("llama", False, False)):
        model = build_model(make_checkpoint(tmp_path / family, family=family, head_dim=32))
        names = {n for n, _ in model.named_parameters()}
        assert ("model.layers.0.self_attn.qkv_proj.bias" in names) == bias, family
        assert ("model.layers.0.self_attn.q_norm.weight" in names) == norms, family


@pytest.mark.gpu
def test_qk_rms_norm_on_cuda_in_bf16_matches_reference():
    qkv = torch.randn(7, (16 + 2 * 8) * 128, device="cuda", dtype=torch.bfloat16) * 4
    q, k = (t.view(7, -1, 128) for t in qkv.split([16 * 128, 8 * 128, 8 * 128], dim=-1)[:2])
    qw, kw = (torch.rand(128, device="cuda", dtype=torch.bfloat16) + 0.5 for _ in range(2))
    expected = qkv.clone()
    eq, ek = (t.view(7, -1, 128) for t in expected.split([16 * 128, 8 * 128, 8 * 128], dim=-1)[:2])
    qk_rms_norm_ref(eq, ek, qw, kw, 1e-6)
    qk_rms_norm_triton(q, k, qw, kw, 1e-6)
    torch.testing.assert_close(qkv, expected, atol=2e-2, rtol=2e-2)
