"""Start-up without timing or serial compiles: the linear picks shipped for known GPUs, the compile-only dry run's
launches, and the line that says what each stage took."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import pytest
import torch
from triton.runtime import jit

from bench.linear_picks import merge
from kernels.gemv import GemvConfig
from tests.test_linear import no_op
from worker import linear_plan as plan
from worker import precompile
from worker.startup import startup_summary

GPU = "NVIDIA Test GPU"
PICKED = GemvConfig(64, 128, 2)


@pytest.fixture
def shipped(monkeypatch, fresh_choices):
    """A shipped file with PICKED for a [96, 64] weight's norm fold at 2 rows and cuBLAS row times for it, on GPU;
    an empty disk cache; every device named GPU; timing fails the test unless a test allows it."""
    path = fresh_choices / "picks.json"
    merge(
        path,
        GPU,
        {
            "gemv fold 'norm' rows 2 w 96x64 torch.float32 bias False fp8 None": dataclasses.asdict(PICKED),
            "gemv fold '' rows 2 w 96x64 torch.float32 bias False fp8 None": None,
            "gemm rows w 96x64 torch.float32 bias True fp8 None": {"24": 5.0, "32": 4.0},
        },
    )
    monkeypatch.setattr(plan, "PICKS_PATH", path)
    monkeypatch.setattr(plan, "_gpu", lambda device: GPU)
    monkeypatch.setattr(plan, "_GEMM_TIMES", {})
    monkeypatch.setattr(plan, "fastest_config", lambda *a: pytest.fail("a shipped pick was timed"))
    monkeypatch.setattr(plan, "_time_rows", lambda *a: pytest.fail("shipped row times were timed"))
    plan.shipped_picks.cache_clear()
    yield path
    plan.shipped_picks.cache_clear()


def test_a_shipped_pick_is_used_without_timing(shipped):
    x, w = torch.randn(2, 64), torch.randn(96, 64)
    assert plan.planned_config("norm", x, w, None, no_op) == PICKED
    assert plan.planned_config("", x, w, None, no_op) is None  # cuBLAS won there: shipped as None
    assert plan.gemm_times(w, torch.randn(96), torch.float32) == {24: 5.0, 32: 4.0}
    assert plan.fastest_rows(plan.gemm_times(w, torch.randn(96), torch.float32), 24) == 32
    assert not (shipped.parent / plan.FILE_NAME).exists()  # nothing timed, nothing written


def test_an_unknown_gpu_or_shape_is_timed_and_kept_on_disk(shipped, monkeypatch):
    timed = []
    monkeypatch.setattr(plan, "fastest_config", lambda fold, rows, w, bias, op: timed.append((fold, w.shape)) or PICKED)
    x = torch.randn(2, 64)
    assert plan.planned_config("norm", x, torch.randn(48, 64), None, no_op) == PICKED  # a shape the file lacks
    monkeypatch.setattr(plan, "_gpu", lambda device: "NVIDIA Other GPU")
    assert (
        plan.planned_config("norm", torch.randn(2, 64, dtype=torch.float64), torch.randn(96, 64), None, no_op) == PICKED
    )
    assert timed == [("norm", (48, 64)), ("norm", (96, 64))]
    assert len(plan.load_choices()) == 2


def test_the_switch_off_times_a_shape_the_file_has(shipped, monkeypatch):
    monkeypatch.setenv(plan.PICKS_ENV, "0")
    monkeypatch.setattr(plan, "fastest_config", lambda *a: GemvConfig(32, 256))
    assert plan.planned_config("norm", torch.randn(2, 64), torch.randn(96, 64), None, no_op) == GemvConfig(32, 256)


def test_a_compile_only_run_looks_picks_up_and_defers_the_untimed_to_the_real_run(shipped, monkeypatch):
    dry = precompile.DryRun()
    monkeypatch.setattr(plan, "dry_run", lambda: dry)
    x, w48 = torch.randn(2, 64), torch.randn(48, 64)
    assert plan.planned_config("norm", x, torch.randn(96, 64), None, no_op) == PICKED and dry.deferred == 0
    assert plan.planned_config("norm", x, w48, None, no_op) is None and dry.deferred == 1
    assert plan.gemm_times(torch.randn(96, 64), torch.randn(96), torch.float32) == {24: 5.0, 32: 4.0}
    assert plan.gemm_times(w48, None, torch.float32) is None and dry.deferred == 2
    assert [key[2] for key in plan._CHOICES] == [96] and len(plan._GEMM_TIMES) == 1  # the untimed stay unknown


@pytest.mark.parametrize("content", ['{"format": 99, "gpus": {}}', "{not json", "[]"])
def test_a_shipped_file_of_another_format_or_unreadable_is_ignored(tmp_path, caplog, content):
    path = tmp_path / "picks.json"
    path.write_text(content)
    assert plan.read_picks(path) == {"format": plan.PICKS_FORMAT, "gpus": {}}
    assert "ignoring the shipped linear picks" in caplog.text


def test_merging_picks_replaces_this_gpus_and_keeps_the_others(tmp_path):
    path = tmp_path / "picks.json"
    merge(path, "A", {"gemv x": None, "gemv y": {"block_n": 8, "block_k": 512}})
    merge(path, "B", {"gemv x": None})
    merge(path, "A", {"gemv y": None})
    data = json.loads(path.read_text())
    assert data["gpus"] == {"A": {"gemv x": None, "gemv y": None}, "B": {"gemv x": None}}
    assert set(data["timed_with"]) == {"A", "B"} and len(data["timed_with"]["A"]["commit"]) >= 40


def test_every_shipped_gemv_pick_is_a_valid_config():
    # A GemvConfig change must come with the file timed again (python -m bench.linear_picks on each GPU).
    for gpu, picks in plan.read_picks(plan.PICKS_PATH)["gpus"].items():
        for key, pick in picks.items():
            assert key.startswith(("gemv fold ", "gemm rows w ")), (gpu, key)
            if key.startswith("gemv") and pick is not None:
                config = GemvConfig(**pick)
                assert config.block_n > 0 and config.block_k > 0 and config.split_k >= 1, (gpu, key)


def test_launches_inside_compile_only_only_compile_and_the_switch_is_restored(monkeypatch):
    calls = []
    monkeypatch.setattr(jit.JITFunction, "run", lambda self, *args, grid, warmup, **kw: calls.append((args, warmup)))

    def kernel(x):
        pass

    jitted = jit.JITFunction(kernel)
    jitted[(1,)](7)
    with pytest.raises(RuntimeError, match="already active"):
        with precompile.compile_only() as dry:
            assert precompile.dry_run() is dry
            jitted[(1,)](8)
            with precompile.compile_only():
                pass
    assert precompile.dry_run() is None and dry.futures == []  # the mocked run submitted no compile
    jitted[(1,)](9)
    assert calls == [((7,), False), ((8,), True), ((9,), False)]


def test_a_dry_run_keeps_each_kernel_it_submits_so_its_next_launch_does_not_compile_it_again(monkeypatch):
    def do_compile(self, key, signature, device, *args):
        return None if key == "left to a hook" else f"kernel {key}"

    monkeypatch.setattr(jit.JITFunction, "_do_compile", do_compile)

    def kernel(x):
        pass

    jitted = jit.JITFunction(kernel)
    jitted.device_caches[0] = ({}, {}, None, None, None)  # (kernels by key, ...) of device 0, as Triton makes them
    with precompile.compile_only():
        assert jitted._do_compile("k", {}, 0) == "kernel k"
        assert jitted._do_compile("left to a hook", {}, 0) is None
    assert jitted.device_caches[0][0] == {"k": "kernel k"}
    assert jit.JITFunction._do_compile is do_compile


def test_a_forked_compile_leaves_its_output_to_the_parent_and_a_stuck_one_is_killed(tmp_path, monkeypatch):
    out = tmp_path / "kernel.cubin"
    precompile.wait_child(precompile.fork_compile(lambda: out.write_text("compiled")))
    assert out.read_text() == "compiled"
    precompile.wait_child(precompile.fork_compile(lambda: 1 / 0))  # a failed child: the thread compiles it again
    stuck, start = precompile.fork_compile(lambda: time.sleep(60)), time.monotonic()
    precompile.wait_child(stuck, timeout=0.2)
    assert time.monotonic() - start < 10
    with pytest.raises(ChildProcessError):  # killed and reaped
        os.waitpid(stuck, os.WNOHANG)
    monkeypatch.setattr(precompile, "CHILD_TIMEOUT_S", 1)
    orphan, start = precompile.fork_compile(lambda: time.sleep(60)), time.monotonic()
    os.waitpid(orphan, 0)  # nobody kills it: its own alarm ends it
    assert time.monotonic() - start < 30


def test_the_startup_line_names_each_stage_and_its_seconds():
    parts = {"weights_s": 0.1, "kernels_compiled": 18, "compile_s": 3.25, "kv_cache_s": 0.96, "graph_capture_s": 1.04}
    clock = {"worker_entered": 100.0, "torch_imported": 103.0, "worker_ready": 108.5}
    assert startup_summary(parts, clock) == (
        "worker ready in 8.50 s: importing torch 3.00 s, weights 0.10 s, compiling 18 Triton kernels 3.25 s, "
        "KV cache 0.96 s, CUDA graphs 1.04 s"
    )


# ---- GPU (the LEAD runs these: python -m pytest -q -s -m gpu tests/test_startup.py) --------------------


@pytest.mark.gpu
def test_a_restart_compiles_every_kernel_in_its_dry_run_and_captures_without_warm_ups(tiny_ckpt, monkeypatch, tmp_path):
    # The second runner finds its linear picks on disk and no kernel in memory: its dry run must compile every
    # kernel the KV cache and the captures launch, with their specialisations (a later compile would show here).
    import sys

    from triton import knobs

    from frontend.model_resolution import resolve_config
    from protocol.config import EngineConfig
    from worker import startup

    monkeypatch.setenv("PICO_VLLM_CACHE", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))  # empty: the first dry run forks its compiles
    monkeypatch.setattr(plan, "_CHOICES", {})
    monkeypatch.setattr(plan, "_GEMM_TIMES", {})
    plan._kept_choices.cache_clear()
    kw = dict(
        model=str(tiny_ckpt),
        device="cuda",
        dtype="bfloat16",
        block_size=16,
        num_kv_blocks=64,
        max_num_seqs=24,
        max_num_batched_tokens=256,
    )  # decode sizes 1-24: GEMV picks and padded cuBLAS rows
    first = startup.build_runner(resolve_config(EngineConfig(**kw)))
    assert first.graphs.warmup_s > 0  # its picks were timed at the warm-ups
    del first
    for module in [m for name, m in sys.modules.items() if name.startswith("kernels.")]:
        for fn in vars(module).values():
            if isinstance(fn, jit.JITFunction):
                fn.device_caches.clear()
    for cache in (plan._CHOICES, plan._GEMM_TIMES):
        cache.clear()
    plan._kept_choices.cache_clear()
    compiled_later = []
    init_kv_cache = startup._init_kv_cache

    def after_the_dry_run(*args):
        monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: compiled_later.append(kw["repr"]))
        init_kv_cache(*args)

    monkeypatch.setattr(startup, "_init_kv_cache", after_the_dry_run)
    compiles, do_compile = [], jit.JITFunction._do_compile
    monkeypatch.setattr(
        jit.JITFunction,
        "_do_compile",
        lambda self, key, *args: compiles.append((self, key)) or do_compile(self, key, *args),
    )
    runner = startup.build_runner(resolve_config(EngineConfig(**kw)))
    assert runner.startup["kernels_compiled"] > 0 and runner.graphs.warmup_s == 0.0
    assert compiled_later == []
    assert len(compiles) == len(set(compiles))  # once per specialisation, not at every launch of the dry run


def test_a_child_of_an_engine_without_bytecode_keeps_its_bytecode_in_our_cache(tmp_path, monkeypatch):
    from frontend.launcher import start_child

    monkeypatch.setenv("PICO_VLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")  # as container images set it
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    (tmp_path / "probe_dep.py").write_text("X = 1\n")
    (tmp_path / "probe_main.py").write_text(
        "import pathlib, sys, probe_dep\n"
        f"pathlib.Path({str(tmp_path / 'out.txt')!r}).write_text(f'{{sys.dont_write_bytecode}} {{sys.pycache_prefix}}')\n"
    )
    assert start_child("probe_main", b"").wait(60) == 0
    assert (tmp_path / "out.txt").read_text() == f"False {tmp_path / 'cache' / 'pycache'}"
    assert list((tmp_path / "cache" / "pycache").rglob("probe_dep*.pyc")), "the child wrote no bytecode in the cache"


def test_imports_inside_cached_bytecode_write_it_under_our_cache_and_the_flags_come_back(tmp_path, monkeypatch):
    from frontend.launcher import cached_bytecode

    monkeypatch.setenv("PICO_VLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "probe_in_process.py").write_text("X = 1\n")
    with cached_bytecode():
        import probe_in_process  # noqa: F401
    assert (sys.dont_write_bytecode, sys.pycache_prefix) == (True, None)
    assert list((tmp_path / "cache" / "pycache").rglob("probe_in_process*.pyc"))
