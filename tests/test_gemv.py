"""The split-K GEMV and the ops folded into it (norm, SwiGLU) against the unfused torch references (CPU: Triton's
interpreter); on the GPU, every candidate at Qwen2.5-1.5B's decode shapes in bfloat16, and graph replay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import gemv
from kernels.gemv import GemvConfig, NormedInput, candidate_configs, gemv_triton, norm_linear_ref, swiglu_linear_ref
from worker.linear import UNFUSED

TOL = dict(atol=1e-4, rtol=1e-4)
SMALL_CONFIGS = [GemvConfig(16, 16, split_k=3), GemvConfig(32, 16)]  # split-K with a short last split; direct
# Qwen2.5-1.5B at TP=1: (N, K, bias) of qkv, o_proj, gate_up, down and the tied lm_head.
QWEN_1_5B = {
    "qkv": (2048, 1536, True),
    "o_proj": (1536, 1536, False),
    "gate_up": (17920, 1536, False),
    "down": (1536, 8960, False),
    "lm_head": (151936, 1536, False),
}


def norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_w: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig,
    swiglu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the GEMV's output with the norm of x + residual folded in, the new residual it wrote)."""
    normed, new_residual = NormedInput.of(x, residual, norm_w, 1e-6)
    return gemv_triton(normed, w, bias, config, swiglu), new_residual


def norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_w: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    linear=F.linear,
    rows: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """norm_gemv's unfused reference: (output, new residual)."""
    normed, new_residual = NormedInput.of(x, residual, norm_w, 1e-6)
    return norm_linear_ref(normed, w, bias, linear, rows), new_residual


def strided_rows(m: int, k: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x[m, k] as a strided view (row stride 2k + 13, column stride 2): a non-contiguous slice, even of one row."""
    x = torch.randn(m, 2 * k + 13, device=device, dtype=dtype)[:, 5 : 5 + 2 * k : 2]
    assert not x.is_contiguous()
    return x


@pytest.mark.parametrize("config", SMALL_CONFIGS, ids=["split-k", "direct"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_gemv_triton_matches_linear_for_one_to_eight_rows(config, with_bias):
    n, k = 45, 100  # neither a multiple of the block sizes
    w = torch.randn(n, k)
    bias = torch.randn(n) if with_bias else None
    for m in range(1, 9):
        x = strided_rows(m, k)
        out = gemv_triton(x, w, bias, config)
        assert out.shape == (m, n) and out.is_contiguous()
        torch.testing.assert_close(out, F.linear(x, w, bias), **TOL)


# Every kernel path a fold takes: the dot kernel split and whole, the one-row kernel over K tiles and whole-K.
FOLD_CONFIGS = [
    GemvConfig(16, 16, split_k=3),
    GemvConfig(32, 32),
    GemvConfig(8, 32, one_row=True),
    GemvConfig(8, 128, one_row=True),
]
FOLD_IDS = ["split-k", "direct", "one-row", "one-row-whole-k"]


def fold_weights(n: int, k: int, dtype: torch.dtype = torch.float32):
    """Weights and a norm weight far from 1, so that a missing or misplaced rstd or norm weight shows."""
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    return w, (torch.randn(n) / 4).to(dtype), (1 + torch.rand(k)).to(dtype)


@pytest.mark.parametrize("config", FOLD_CONFIGS, ids=FOLD_IDS)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-layer"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_norm_gemv_equals_add_rms_norm_then_linear(config, with_residual, with_bias):
    n, k = 45, 100  # neither a multiple of the block sizes; the split-K configs leave a short last split
    w, bias, norm_w = fold_weights(n, k)
    for m in [1] if config.one_row else [1, 3, 5]:
        x, residual = 3 * torch.randn(m, k), (torch.randn(m, k) if with_residual else None)
        out, new_residual = norm_gemv(x, residual, norm_w, w, bias if with_bias else None, config)
        ref, ref_residual = norm_ref(x, residual, norm_w, w, bias if with_bias else None)
        assert out.shape == (m, n) and out.is_contiguous()
        torch.testing.assert_close(out, ref, **TOL)
        assert torch.equal(new_residual, ref_residual)  # x + residual, stored by the programs of column 0
        assert with_residual or new_residual is x


def test_norm_gemv_takes_strided_rows_and_rounds_the_sum_to_float16():
    w, bias, norm_w = fold_weights(45, 100, torch.float16)
    x, residual = strided_rows(4, 100, dtype=torch.float16), 20 * torch.randn(4, 100, dtype=torch.float16)
    for config in FOLD_CONFIGS[:2]:
        out, new_residual = norm_gemv(x, residual, norm_w, w, bias, config)
        ref, ref_residual = norm_ref(x, residual, norm_w, w, bias)
        assert torch.equal(new_residual, ref_residual)
        torch.testing.assert_close(out, ref, atol=4e-3, rtol=4e-3)  # roundings differ: norm_w * s, not normed


WHOLE_K = [(c, i) for c, i in zip(FOLD_CONFIGS, FOLD_IDS) if c.split_k == 1]  # what SwiGLU takes


@pytest.mark.parametrize("config", [c for c, _ in WHOLE_K], ids=[i for _, i in WHOLE_K])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_swiglu_gemv_equals_linear_then_silu_and_mul(config, dtype, with_bias):
    n, k = 90, 100  # [gate | up] of 45 rows each: a tile straddles the end of gate
    w, bias, _ = fold_weights(n, k, dtype)
    bias = bias if with_bias else None
    tol = TOL if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    for m in [1] if config.one_row else [1, 3, 5]:
        x = strided_rows(m, k, dtype=dtype)
        out = gemv_triton(x, w, bias, config, swiglu=True)
        assert out.shape == (m, n // 2) and out.is_contiguous()
        torch.testing.assert_close(out, swiglu_linear_ref(x, w, bias), **tol)


@pytest.mark.parametrize("config", [c for c, _ in WHOLE_K], ids=[i for _, i in WHOLE_K])
def test_norm_and_swiglu_in_one_gemv_equal_the_unfused_ops(config):
    w, bias, norm_w = fold_weights(90, 100)
    for m in [1] if config.one_row else [1, 4]:
        x, residual = 3 * torch.randn(m, 100), torch.randn(m, 100)
        out, new_residual = norm_gemv(x, residual, norm_w, w, bias, config, swiglu=True)
        ref, ref_residual = norm_ref(x, residual, norm_w, w, bias, linear=swiglu_linear_ref)
        torch.testing.assert_close(out, ref, **TOL)
        assert torch.equal(new_residual, ref_residual)


@pytest.mark.parametrize("block_k", [32, 128], ids=["k-tiles", "whole-k"])
def test_one_row_programs_walking_blocks_equal_a_program_a_block(block_k, monkeypatch):
    # One "SM", 3 programs: each walks 4 of the 12 blocks of 4 rows (the last block short) and loads the
    # next block's first tile while it finishes this one; the sums per element are the same, so the bits are.
    monkeypatch.setattr(gemv, "num_sms", lambda device: 1)
    walking, a_block = GemvConfig(4, block_k, one_row=True, per_sm=3), GemvConfig(4, block_k, one_row=True)
    w, bias, norm_w = fold_weights(90, 100)
    x, residual = 3 * torch.randn(1, 100), torch.randn(1, 100)
    for swiglu, n in ((False, 45), (True, 90)):
        outs = [norm_gemv(x, residual, norm_w, w[:n], bias[:n], c, swiglu) for c in (walking, a_block)]
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        ref = norm_ref(x, residual, norm_w, w[:n], bias[:n], linear=swiglu_linear_ref if swiglu else F.linear)
        torch.testing.assert_close(outs[0][0], ref[0], **TOL)
        assert torch.equal(gemv_triton(x, w[:n], None, walking, swiglu), gemv_triton(x, w[:n], None, a_block, swiglu))


def test_swiglu_gemv_refuses_split_k_and_an_odd_weight():
    with pytest.raises(ValueError, match="split_k = 1, got 3"):
        gemv_triton(torch.randn(1, 100), torch.randn(90, 100), None, GemvConfig(16, 16, split_k=3), swiglu=True)
    with pytest.raises(ValueError, match="even row count, got 45"):
        gemv_triton(torch.randn(1, 100), torch.randn(45, 100), None, GemvConfig(32, 32), swiglu=True)
    assert all(c.split_k == 1 for c in candidate_configs(64, 8960, 132, rows=1, swiglu=True))


def test_gemv_triton_takes_more_rows_than_one_tile():
    w, bias = torch.randn(70, 300), torch.randn(70)
    x = strided_rows(gemv.BLOCK_M + 3, 300)
    torch.testing.assert_close(gemv_triton(x, w, bias, candidate_configs(70, 300, 132)[0]), F.linear(x, w, bias), **TOL)


@pytest.mark.parametrize("shape", QWEN_1_5B.values(), ids=QWEN_1_5B.keys())
def test_candidates_give_every_sm_two_programs_and_no_empty_split(shape):
    n, k, _ = shape
    for cfg in candidate_configs(n, k, num_sms=132):
        chunks = -(-k // cfg.block_k)
        per_split = -(-chunks // cfg.split_k)
        assert (cfg.split_k - 1) * per_split < chunks  # the last split has work
        assert -(-n // cfg.block_n) * cfg.split_k >= 2 * 132 or per_split == 1


# ---- GPU (the LEAD runs these: python -m pytest -q -s -m gpu tests/test_gemv.py) ----------------------


def _weights(name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    n, k, has_bias = QWEN_1_5B[name]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    return w, (torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("name", QWEN_1_5B, ids=QWEN_1_5B.keys())
def test_every_candidate_matches_float32_at_qwen_shapes_in_bf16(name):
    w, bias = _weights(name)
    for m in (1, 4, 8, 16):
        x = torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        for cfg in candidate_configs(*w.shape, gemv.num_sms(x.device), rows=m):  # one-row kernels at m = 1
            out = gemv_triton(x, w, bias, cfg)
            assert _rel_err(out, ref) <= 1e-2, (name, m, cfg)
            assert torch.equal(out, gemv_triton(x, w, bias, cfg)), "split-K sums must be reproducible"


@pytest.mark.gpu
def test_graph_replay_of_the_gemv_equals_the_eager_call():
    w, bias = _weights("qkv")
    x = strided_rows(4, w.shape[1], "cuda", torch.bfloat16)
    cfg = candidate_configs(*w.shape, gemv.num_sms(x.device))[0]
    eager = gemv_triton(x, w, bias, cfg)  # also compiles before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv_triton(x, w, bias, cfg)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, gemv_triton(x, w, bias, cfg)) and not torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("fold,name", [("norm", "qkv"), ("swiglu", "gate_up"), ("norm+swiglu", "gate_up")])
def test_every_fused_candidate_matches_the_unfused_float32_path_at_qwen_shapes_in_bf16(fold, name):
    from bench.kernels import fold_inputs

    def as_input(inputs: tuple):
        return NormedInput.of(*inputs)[0] if fold.startswith("norm") else inputs[0]

    w, bias = _weights(name)
    for m in (1, 4, 16):
        inputs = fold_inputs(fold, m, w.shape[1])
        x = as_input(inputs)
        ref = UNFUSED[fold](
            as_input(tuple(t.float() if torch.is_tensor(t) else t for t in inputs)),
            w.float(),
            None if bias is None else bias.float(),
        )
        for cfg in candidate_configs(*w.shape, gemv.num_sms(w.device), rows=m, swiglu=fold.endswith("swiglu")):
            if fold.startswith("norm"):
                x.residual_out.zero_()
            out = gemv_triton(x, w, bias, cfg, fold.endswith("swiglu"))
            if fold.startswith("norm"):  # the new residual, in bf16
                assert torch.equal(x.residual_out, inputs[0] + inputs[1]), (name, m, cfg)
            assert _rel_err(out, ref) <= 1e-2, (name, m, cfg)


@pytest.mark.gpu
def test_graph_replay_of_the_split_k_norm_gemv_equals_the_eager_call():
    from bench.kernels import fold_inputs

    w, bias = _weights("qkv")
    x, residual, norm_w, eps = fold_inputs("norm", 4, w.shape[1])
    cfg = candidate_configs(*w.shape, gemv.num_sms(x.device))[0]
    assert cfg.split_k > 1
    normed, new_residual = NormedInput.of(x, residual, norm_w, eps)
    eager = gemv_triton(normed, w, bias, cfg)  # also compiles before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv_triton(normed, w, bias, cfg)
    x.copy_(torch.randn_like(x))
    graph.replay()
    again = norm_gemv(x, residual, norm_w, w, bias, cfg)
    assert torch.equal(out, again[0]) and torch.equal(new_residual, again[1]) and not torch.equal(out, eager)


def test_programmatic_dependent_launch_is_off_the_gpu_and_when_turned_off(monkeypatch):
    from kernels import pdl

    assert not pdl.pdl_enabled(torch.device("cpu")) and pdl.pdl_launch(torch.device("cpu")) == {}
    pdl.pdl_enabled.cache_clear()
    monkeypatch.setenv(pdl.ENV, "0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: pytest.fail("not asked when off"))
    assert not pdl.pdl_enabled(torch.device("cuda", 0))
    pdl.pdl_enabled.cache_clear()
