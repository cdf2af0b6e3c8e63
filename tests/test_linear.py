"""Which path a linear runs (kernels/linear.py): the unfused references off the GPU, the capture rule, the
unfused side timed with its folded ops' kernels, the winner run; on the GPU, the chosen path's speed."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from kernels import linear as lin
from kernels import tuning_cache
from kernels.activation import silu_and_mul_ref
from kernels.gemv import (GemvConfig, candidate_configs, gemv_triton, norm_gemv_triton, norm_linear_ref,
                          swiglu_linear_ref)
from kernels.linear import linear, norm_linear
from kernels.norm import add_rms_norm_ref, rms_norm_ref


def test_off_the_gpu_every_op_is_its_unfused_torch_reference_without_a_choice(monkeypatch):
    monkeypatch.setattr(lin, "cached_choice", lambda *a: pytest.fail("CPU tensors must not be timed"))
    x, residual, norm_w = torch.randn(2, 24), torch.randn(2, 24), torch.rand(24)
    w, bias = torch.randn(8, 24), torch.randn(8)
    assert torch.equal(linear(x, w, bias), F.linear(x, w, bias))
    out, new_residual = norm_linear(x, residual, norm_w, 1e-6, w, bias)
    normed, ref_residual = add_rms_norm_ref(x, residual, norm_w, 1e-6)
    assert torch.equal(out, F.linear(normed, w, bias)) and torch.equal(new_residual, ref_residual)
    out, new_residual = norm_linear(x, None, norm_w, 1e-6, w)
    assert torch.equal(out, F.linear(rms_norm_ref(x, norm_w, 1e-6), w)) and new_residual is x
    assert torch.equal(linear(x, w, bias, swiglu=True), silu_and_mul_ref(F.linear(x, w, bias)))
    out, new_residual = norm_linear(x, residual, norm_w, 1e-6, w, swiglu=True)
    assert torch.equal(out, silu_and_mul_ref(F.linear(normed, w))) and torch.equal(new_residual, ref_residual)


@pytest.fixture
def fresh_choices(monkeypatch, tmp_path):
    """No pick in memory, an empty disk cache under tmp_path, nothing read from it yet, no capture."""
    monkeypatch.setattr(lin, "_CHOICES", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv("PICO_VLLM_CACHE", str(tmp_path))
    lin._kept_choices.cache_clear()
    yield tmp_path
    lin._kept_choices.cache_clear()


def test_a_shape_first_met_during_capture_runs_unfused_and_is_chosen_at_the_next_eager_call(monkeypatch,
                                                                                            fresh_choices):
    capturing, timed = [True], []
    picked = GemvConfig(64, 128)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(lin, "fastest_config", lambda fold, inputs, w, bias: timed.append(
        (fold, inputs[0].shape[0])) or picked)
    w = torch.randn(8, 24)
    assert lin.cached_choice("", (torch.randn(3, 24),), w, None) is None  # unfused while capturing, untimed
    assert timed == [] and lin._CHOICES == {}
    capturing[0] = False
    assert lin.cached_choice("", (torch.randn(3, 24),), w, None) == picked
    assert lin.cached_choice("", (torch.randn(4, 24),), w, None) == picked  # 3 and 4 rows share the bucket of 4
    capturing[0] = True
    assert lin.cached_choice("", (torch.randn(4, 24),), w, None) == picked  # a graph replays the eager pick
    assert lin.cached_choice("norm", (torch.randn(4, 24), None, torch.rand(24), 1e-6), w, None) is None
    capturing[0] = False
    assert lin.cached_choice("norm", (torch.randn(4, 24), None, torch.rand(24), 1e-6), w, None) == picked
    assert timed == [("", 3), ("norm", 4)]  # a fold is a shape of its own


def test_choices_are_kept_on_disk_for_the_next_process_until_the_kernel_source_changes(monkeypatch,
                                                                                        fresh_choices):
    timed = []
    monkeypatch.setattr(lin, "fastest_config", lambda fold, inputs, w, bias: timed.append(w.shape) or (
        GemvConfig(4, 2048, one_row=True) if w.shape[0] == 8 else None))
    x, w8, w16 = torch.randn(1, 24), torch.randn(8, 24), torch.randn(16, 24)
    assert lin.cached_choice("", (x,), w8, None) == GemvConfig(4, 2048, one_row=True)
    assert lin.cached_choice("", (x,), w16, None) is None  # the unfused path won: kept too, not timed again
    assert timed == [(8, 24), (16, 24)]

    def new_process():
        lin._CHOICES.clear()
        lin._kept_choices.cache_clear()

    new_process()
    assert lin.cached_choice("", (x,), w8, None) == GemvConfig(4, 2048, one_row=True)
    assert lin.cached_choice("", (x,), w16, None) is None and len(timed) == 2
    new_process()
    monkeypatch.setattr(tuning_cache, "source_hash", lambda path: "edited")
    assert lin.cached_choice("", (x,), w8, None) == GemvConfig(4, 2048, one_row=True) and len(timed) == 3


def test_an_unreadable_choice_cache_means_timing_again(monkeypatch, fresh_choices, caplog):
    (fresh_choices / tuning_cache.FILE_NAME).write_text("{not json")
    monkeypatch.setattr(lin, "fastest_config", lambda fold, inputs, w, bias: GemvConfig(64, 128))
    assert lin.cached_choice("", (torch.randn(2, 24),), torch.randn(8, 24), None) == GemvConfig(64, 128)
    assert "ignoring the kernel choice cache" in caplog.text
    assert list(json.loads((fresh_choices / tuning_cache.FILE_NAME).read_text()).values()) == [
        dataclasses.asdict(GemvConfig(64, 128))]


@pytest.mark.parametrize("fast", [GemvConfig(8, 512, 1, one_row=True), None], ids=["one-row-wins", "unfused-wins"])
def test_the_unfused_side_is_timed_with_its_norm_and_the_faster_side_runs(monkeypatch, fast):
    ran = []  # the paths graph_us ran, in order: "unfused" or a config
    monkeypatch.setitem(lin.PATHS, "norm", (lambda *a: ran.append("unfused") or norm_linear_ref(*a),
                                            lambda *a: ran.append(a[-1]) or norm_gemv_triton(*a)))
    monkeypatch.setattr(lin, "cold_copies", lambda w, bias: [(w, bias)])
    monkeypatch.setattr(lin, "graph_us", lambda calls: [call() for call in calls] and (
        0.5 if ran[-1] == fast else 1.0 if ran[-1] == "unfused" else 2.0))
    x, residual, norm_w, w = torch.randn(1, 100), torch.randn(1, 100), torch.rand(100), torch.randn(45, 100)
    inputs = (x, residual, norm_w, 1e-6)
    assert lin.fastest_config("norm", inputs, w, None) == fast
    assert ran == ["unfused", *candidate_configs(45, 100, 132, rows=1)]  # one-row candidates too, at one row
    ran.clear()
    monkeypatch.setattr(lin, "choice", lambda *a: fast)
    out, new_residual = norm_linear(x, residual, norm_w, 1e-6, w)
    assert ran == [fast or "unfused"]
    ref, ref_residual = norm_linear_ref(*inputs, w)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(new_residual, ref_residual)


def test_the_unfused_norm_and_swiglu_run_their_linear_by_linears_own_pick(monkeypatch):
    plain = GemvConfig(32, 32)  # what linear() picked for the plain shape: a Triton GEMV, not cuBLAS
    ran = []
    monkeypatch.setitem(lin.PATHS, "", (F.linear, lambda *a: ran.append(a[-1]) or gemv_triton(*a)))
    monkeypatch.setattr(lin, "choice", lambda fold, *a: plain if fold == "" else None)
    x, residual, norm_w, w = torch.randn(2, 24), torch.randn(2, 24), torch.rand(24), torch.randn(8, 24)
    out, _ = norm_linear(x, residual, norm_w, 1e-6, w)
    torch.testing.assert_close(out, norm_linear_ref(x, residual, norm_w, 1e-6, w)[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(linear(x, w, swiglu=True), swiglu_linear_ref(x, w), atol=1e-4, rtol=1e-4)
    assert ran == [plain, plain]


# ---- GPU (the LEAD runs these: python -m pytest -q -s -m gpu tests/test_linear.py) --------------------

@pytest.mark.gpu
def test_chosen_path_is_not_slower_than_the_unfused_one_at_qwen_shapes():
    from bench.kernels import time_linears
    from protocol.model_config import resolve_model

    config, _ = resolve_model("qwen2.5-1.5b", load_format="dummy")
    for row in time_linears(config, [1, 8]):
        print(f"M={row['rows']} {row['linear']:8s} {row['fold']:11s} unfused {row['unfused_us']:7.2f} us | "
              f"chosen {row['chosen_us']:7.2f} us {row['chosen_tb_s']:5.2f} TB/s | {row['chosen']}")
        assert row["chosen_us"] <= 1.10 * row["unfused_us"], row
