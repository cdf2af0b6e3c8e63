"""gate_up + SwiGLU of many rows in one GEMM (kernels/gemm.py) against the unfused reference (CPU: Triton's
interpreter, float32), how kernels/linear.py offers it, and on the GPU every candidate at Qwen2.5-1.5B's gate_up in
bfloat16, with graph replay."""
from __future__ import annotations

import pytest
import torch

from kernels import gemm
from kernels import linear as lin
from kernels.gemm import GemmConfig, swiglu_gemm_triton
from kernels.gemv import GemvConfig, candidate_configs, swiglu_linear_ref

SMALL = GemmConfig(block_m=16, block_n=32, block_k=64, num_stages=2)


@pytest.mark.parametrize("m", [1, 40])
def test_swiglu_gemm_equals_linear_then_silu_and_mul_with_tails_in_every_dim(m):
    # 40 rows: a short last row tile; I = 48: a short last column tile; K = 96: a short last K tile (zeros by TMA).
    x, w = torch.randn(m, 96), torch.randn(2 * 48, 96)
    torch.testing.assert_close(swiglu_gemm_triton(x, w, config=SMALL), swiglu_linear_ref(x, w), atol=1e-4, rtol=1e-4)


def test_swiglu_gemm_refuses_a_bias_and_an_odd_or_mismatched_weight():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="no bias"):
        swiglu_gemm_triton(x, torch.randn(32, 64), torch.randn(32), SMALL)
    with pytest.raises(ValueError, match=r"w = \[gate \| up\]"):
        swiglu_gemm_triton(x, torch.randn(33, 64), config=SMALL)
    with pytest.raises(ValueError, match=r"x\[4, 64\]"):
        swiglu_gemm_triton(x, torch.randn(32, 48), config=SMALL)


def test_the_swiglu_path_runs_the_gemm_for_a_gemm_config_and_the_gemv_for_a_gemv_config():
    x, w = torch.randn(24, 64), torch.randn(64, 64)
    ref = swiglu_linear_ref(x, w)
    torch.testing.assert_close(lin.run_path("swiglu", (x,), w, None, SMALL), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lin.run_path("swiglu", (x[:2],), w, None, GemvConfig(32, 32)), ref[:2], atol=1e-4,
                               rtol=1e-4)


def test_gemm_candidates_only_past_the_gemv_rows_without_bias_and_where_tma_can_load():
    w = torch.randn(64, 64)
    assert lin._candidates("swiglu", torch.randn(8, 64), w, None) == candidate_configs(64, 64, 132, 8, True)
    assert lin._candidates("swiglu", torch.randn(32, 64), w, None) == []  # off the GPU: no TMA
    assert gemm._tma_ready(torch.randn(32, 64)) and not gemm._tma_ready(torch.randn(32, 63))  # 252-byte rows
    assert not gemm._tma_ready(torch.randn(32, 128)[:, ::2])  # no unit column stride


def test_rows_share_a_pick_by_powers_of_two_then_by_multiples_of_64():
    assert [lin.rows_bucket(m) for m in (1, 3, 16, 17, 33, 64, 65, 128, 129, 192, 193, 256)] == [
        1, 4, 16, 32, 64, 64, 128, 128, 192, 192, 256, 256]


def test_a_gemm_pick_is_kept_on_disk_as_a_gemm_config(monkeypatch, tmp_path):
    monkeypatch.setattr(lin, "_CHOICES", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv("PICO_VLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(lin, "fastest_config", lambda *a: SMALL)
    lin._kept_choices.cache_clear()
    x, w = torch.randn(100, 64), torch.randn(64, 64)
    assert lin.cached_choice("swiglu", (x,), w, None) == SMALL
    lin._CHOICES.clear()
    lin._kept_choices.cache_clear()
    monkeypatch.setattr(lin, "fastest_config", lambda *a: pytest.fail("the pick is on disk"))
    assert lin.cached_choice("swiglu", (x,), w, None) == SMALL
    lin._kept_choices.cache_clear()


# ---- GPU -------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 64, 192, 256])
def test_every_gemm_candidate_matches_float32_at_qwen_gate_up_in_bf16(m):
    w = torch.randn(17920, 1536, device="cuda", dtype=torch.bfloat16) / 1536 ** 0.5
    x = torch.randn(m, 1536, device="cuda", dtype=torch.bfloat16)
    ref = swiglu_linear_ref(x.float(), w.float())
    unfused = swiglu_linear_ref(x, w)
    configs = gemm.candidate_configs(x, w)
    assert configs, "an H100/H200 must offer the GEMM"
    for config in configs:
        out = swiglu_gemm_triton(x, w, config=config)
        assert ((out.float() - ref).norm() / ref.norm()).item() <= 1e-2, config
        assert ((out.float() - unfused.float()).norm() / ref.norm()).item() <= 1e-2, config
        assert torch.equal(out, swiglu_gemm_triton(x, w, config=config)), "the same bits every run"


@pytest.mark.gpu
def test_graph_replay_of_the_swiglu_gemm_equals_the_eager_call():
    w = torch.randn(17920, 1536, device="cuda", dtype=torch.bfloat16) / 1536 ** 0.5
    x = torch.randn(96, 1536, device="cuda", dtype=torch.bfloat16)
    eager = swiglu_gemm_triton(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = swiglu_gemm_triton(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, swiglu_gemm_triton(x, w)) and not torch.equal(out, eager)
