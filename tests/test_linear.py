"""Which path a linear runs (worker/linear.py, planned by worker/linear_plan.py): the unfused references off the
GPU, the capture rule, the unfused side timed with its folded ops' kernels, the winner run; on the GPU, the chosen
path's speed."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul_ref
from kernels.gemv import GemvConfig, NormedInput, candidate_configs, gemv_triton, swiglu_linear_ref
from kernels.norm import rms_norm_ref
from tests.test_gemv import norm_ref
from worker import linear as lin
from worker import linear_plan as plan
from worker.linear import linear


def norm_linear(x, residual, norm_w, eps, w, bias=None, swiglu=False):
    """(linear of the normed x + residual, the new residual), as a decoder layer runs it."""
    normed, new_residual = NormedInput.of(x, residual, norm_w, eps)
    return linear(normed, w, bias, swiglu), new_residual


def no_op(w, bias, config):
    return pytest.fail("a mocked plan runs no op")


def test_off_the_gpu_every_op_is_its_unfused_torch_reference_without_a_choice(monkeypatch):
    monkeypatch.setattr(plan, "planned_config", lambda *a: pytest.fail("CPU tensors must not be timed"))
    monkeypatch.setattr(plan, "gemm_times", lambda *a: pytest.fail("CPU tensors must not be timed"))
    x, residual, norm_w = torch.randn(2, 24), torch.randn(2, 24), torch.rand(24)
    w, bias = torch.randn(8, 24), torch.randn(8)
    assert torch.equal(linear(x, w, bias), F.linear(x, w, bias))
    out, new_residual = norm_linear(x, residual, norm_w, 1e-6, w, bias)
    ref_residual = x + residual
    normed = rms_norm_ref(ref_residual, norm_w, 1e-6)
    assert torch.equal(out, F.linear(normed, w, bias)) and torch.equal(new_residual, ref_residual)
    out, new_residual = norm_linear(x, None, norm_w, 1e-6, w)
    assert torch.equal(out, F.linear(rms_norm_ref(x, norm_w, 1e-6), w)) and new_residual is x
    assert torch.equal(linear(x, w, bias, swiglu=True), silu_and_mul_ref(F.linear(x, w, bias)))
    out, new_residual = norm_linear(x, residual, norm_w, 1e-6, w, swiglu=True)
    assert torch.equal(out, silu_and_mul_ref(F.linear(normed, w))) and torch.equal(new_residual, ref_residual)


def test_a_shape_first_met_during_capture_runs_unfused_and_is_chosen_at_the_next_eager_call(monkeypatch, fresh_choices):
    capturing, timed = [True], []
    picked = GemvConfig(64, 128)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(plan, "fastest_config", lambda fold, rows, w, bias, op: timed.append((fold, rows)) or picked)
    w = torch.randn(8, 24)
    assert plan.planned_config("", torch.randn(3, 24), w, None, no_op) is None  # unfused while capturing, untimed
    assert timed == [] and plan._CHOICES == {}
    capturing[0] = False
    assert plan.planned_config("", torch.randn(3, 24), w, None, no_op) == picked
    assert plan.planned_config("", torch.randn(4, 24), w, None, no_op) == picked  # 3 and 4 rows: the bucket of 4
    capturing[0] = True
    assert plan.planned_config("", torch.randn(4, 24), w, None, no_op) == picked  # a graph replays the eager pick
    assert plan.planned_config("norm", torch.randn(4, 24), w, None, no_op) is None
    capturing[0] = False
    assert plan.planned_config("norm", torch.randn(4, 24), w, None, no_op) == picked
    assert timed == [("", 3), ("norm", 4)]  # a fold is a shape of its own


def test_choices_are_kept_on_disk_for_the_next_process_until_the_kernel_source_changes(monkeypatch, fresh_choices):
    timed = []
    monkeypatch.setattr(
        plan,
        "fastest_config",
        lambda fold, rows, w, bias, op: (
            timed.append(w.shape) or (GemvConfig(4, 2048, one_row=True) if w.shape[0] == 8 else None)
        ),
    )
    x, w8, w16 = torch.randn(1, 24), torch.randn(8, 24), torch.randn(16, 24)
    assert plan.planned_config("", x, w8, None, no_op) == GemvConfig(4, 2048, one_row=True)
    assert plan.planned_config("", x, w16, None, no_op) is None  # the unfused path won: kept too, not timed again
    assert timed == [(8, 24), (16, 24)]

    def new_process():
        plan._CHOICES.clear()
        plan._kept_choices.cache_clear()

    new_process()
    assert plan.planned_config("", x, w8, None, no_op) == GemvConfig(4, 2048, one_row=True)
    assert plan.planned_config("", x, w16, None, no_op) is None and len(timed) == 2
    new_process()
    monkeypatch.setattr(plan, "source_hash", lambda path: "edited")
    assert plan.planned_config("", x, w8, None, no_op) == GemvConfig(4, 2048, one_row=True) and len(timed) == 3


def test_an_unreadable_choice_cache_means_timing_again(monkeypatch, fresh_choices, caplog):
    (fresh_choices / plan.FILE_NAME).write_text("{not json")
    monkeypatch.setattr(plan, "fastest_config", lambda fold, rows, w, bias, op: GemvConfig(64, 128))
    assert plan.planned_config("", torch.randn(2, 24), torch.randn(8, 24), None, no_op) == GemvConfig(64, 128)
    assert "ignoring the kernel choice cache" in caplog.text
    assert list(json.loads((fresh_choices / plan.FILE_NAME).read_text()).values()) == [
        dataclasses.asdict(GemvConfig(64, 128))
    ]


@pytest.mark.parametrize("fast", [GemvConfig(8, 512, 1, one_row=True), None], ids=["one-row-wins", "unfused-wins"])
def test_the_unfused_side_is_timed_with_its_norm_and_the_faster_side_runs(monkeypatch, fast):
    ran = []  # the paths graph_us ran, in order: "unfused" or a config
    unfused = lin.UNFUSED["norm"]
    monkeypatch.setitem(lin.UNFUSED, "norm", lambda *a: ran.append("unfused") or unfused(*a))
    monkeypatch.setattr(lin, "gemv_triton", lambda *a: ran.append(a[3]) or gemv_triton(*a))
    monkeypatch.setattr(plan, "cold_copies", lambda w, bias: [(w, bias)])
    monkeypatch.setattr(
        plan,
        "graph_us",
        lambda calls: [call() for call in calls] and (0.5 if ran[-1] == fast else 1.0 if ran[-1] == "unfused" else 2.0),
    )
    x, residual, norm_w, w = torch.randn(1, 100), torch.randn(1, 100), torch.rand(100), torch.randn(45, 100)
    inputs = (x, residual, norm_w, 1e-6)
    op = functools.partial(lin.run_path, "norm", NormedInput.of(*inputs)[0])
    assert plan.fastest_config("norm", 1, w, None, op) == fast
    assert ran == ["unfused", *candidate_configs(45, 100, 132, rows=1)]  # one-row candidates too, at one row
    ran.clear()
    monkeypatch.setattr(lin, "choice", lambda *a: fast)
    out, new_residual = norm_linear(x, residual, norm_w, 1e-6, w)
    assert ran == [fast or "unfused"]
    ref, ref_residual = norm_ref(x, residual, norm_w, w)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(new_residual, ref_residual)


def test_the_unfused_norm_and_swiglu_run_their_linear_by_linears_own_pick(monkeypatch):
    plain = GemvConfig(32, 32)  # what linear() picked for the plain shape: a Triton GEMV, not cuBLAS
    ran = []
    monkeypatch.setattr(lin, "gemv_triton", lambda *a: ran.append(a[3]) or gemv_triton(*a))
    monkeypatch.setattr(lin, "choice", lambda fold, *a: plain if fold == "" else None)
    x, residual, norm_w, w = torch.randn(2, 24), torch.randn(2, 24), torch.rand(24), torch.randn(8, 24)
    out, _ = norm_linear(x, residual, norm_w, 1e-6, w)
    torch.testing.assert_close(out, norm_ref(x, residual, norm_w, w)[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(linear(x, w, swiglu=True), swiglu_linear_ref(x, w), atol=1e-4, rtol=1e-4)
    assert ran == [plain, plain]


def test_fastest_rows_pads_only_to_a_timed_row_count_faster_by_the_margin():
    times = {24: 10.0, 32: 20.0, 40: 9.8, 48: 30.0}
    assert plan.fastest_rows(times, 24) == 24  # 40 rows are faster, but by less than 3%
    assert plan.fastest_rows(times, 32) == 40
    assert plan.fastest_rows(times, 40) == 40 and plan.fastest_rows(times, 48) == 48
    assert plan.fastest_rows(times, 36) == 36 and plan.fastest_rows(times, 64) == 64  # never timed: as they are


def test_a_padded_norm_linear_runs_its_gemm_on_the_padded_rows_and_returns_the_steps(monkeypatch):
    gemm_rows = []
    monkeypatch.setitem(lin.UNFUSED, "", lambda x, w, b=None: gemm_rows.append(x.shape[0]) or F.linear(x, w, b))
    monkeypatch.setattr(plan, "padded_rows", lambda x, w, bias, gemm: x.shape[0] + 8)
    x, residual, norm_w, w, bias = torch.randn(3, 24), torch.randn(3, 24), torch.rand(24), torch.randn(8, 24), None
    for res in (residual, None):
        out, new_residual = norm_linear(x, res, norm_w, 1e-6, w, bias)
        ref, ref_residual = norm_ref(x, res, norm_w, w, bias)
        assert out.shape == (3, 8) and torch.equal(new_residual, ref_residual)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out, _ = norm_linear(x, residual, norm_w, 1e-6, torch.randn(16, 24), swiglu=True)
    assert out.shape == (3, 8) and gemm_rows == [11, 11, 11]


def test_gemm_row_times_are_timed_once_kept_on_disk_and_never_while_capturing(monkeypatch, fresh_choices):
    monkeypatch.setattr(plan, "_GEMM_TIMES", {})
    timed, capturing = [], [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(
        plan, "_time_rows", lambda w, bias, dtype, gemm: timed.append(w.shape) or {"24": 2.0, "32": 1.0}
    )
    w = torch.randn(8, 24)
    assert plan.gemm_times(w, None, torch.float32) is None and timed == []
    capturing[0] = False
    assert plan.gemm_times(w, None, torch.float32) == {24: 2.0, 32: 1.0}
    assert plan.gemm_times(w, None, torch.float32) == {24: 2.0, 32: 1.0} and len(timed) == 1
    plan._GEMM_TIMES.clear()
    plan._kept_choices.cache_clear()  # a new process reads the disk cache
    assert plan.gemm_times(w, None, torch.float32) == {24: 2.0, 32: 1.0} and len(timed) == 1
    assert plan.gemm_times(w, torch.randn(8), torch.float32) and len(timed) == 2  # a bias is a shape of its own


# ---- GPU (the LEAD runs these: python -m pytest -q -s -m gpu tests/test_linear.py) --------------------


@pytest.mark.gpu
def test_chosen_path_is_not_slower_than_the_unfused_one_at_qwen_shapes():
    from bench.kernels import time_linears
    from frontend.model_resolution import resolve_model

    config, _ = resolve_model("qwen2.5-1.5b", load_format="dummy")
    for row in time_linears(config, [1, 8]):
        print(
            f"M={row['rows']} {row['linear']:8s} {row['fold']:11s} unfused {row['unfused_us']:7.2f} us | "
            f"chosen {row['chosen_us']:7.2f} us {row['chosen_tb_s']:5.2f} TB/s | {row['chosen']}"
        )
        assert row["chosen_us"] <= 1.10 * row["unfused_us"], row


@pytest.mark.gpu
def test_padded_rows_are_timed_faster_and_give_the_unpadded_output_at_qwen_shapes():
    # cuBLAS on more rows than the step's must be faster where chosen, and its step rows must equal an unpadded
    # run's up to the accumulation order of another kernel.
    dev, dt = torch.device("cuda"), torch.bfloat16
    norm_w = torch.rand(1536, device=dev, dtype=dt)
    for n in (2048, 17920):  # qkv, gate_up
        w = torch.randn(n, 1536, device=dev, dtype=dt) * 0.02
        times = plan.gemm_times(w, None, dt)
        assert sorted(times) == list(range(24, 257, 8))
        for m in (40, 192, 216):
            rows = plan.fastest_rows(times, m)
            assert rows >= m and times[rows] <= times[m]
            x, residual = torch.randn(m, 1536, device=dev, dtype=dt), torch.randn(m, 1536, device=dev, dtype=dt)
            padded, _ = norm_ref(x, residual, norm_w, w, rows=m + 8)
            plain, _ = norm_ref(x, residual, norm_w, w)
            assert padded.shape == plain.shape == (m, n)
            torch.testing.assert_close(padded, plain, atol=2e-2, rtol=2e-2)
