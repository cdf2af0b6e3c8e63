"""The benchmarks run end to end on a tiny checkpoint (CPU) and record what a result must hold."""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from bench import common
from bench.common import param_count, roofline
from bench.gpu_tests import _Outcomes
from bench.hf import hf_config
from bench.profile import HOST_GAP, critical_path
from frontend.model_resolution import config_from_dir, short_model

REPO = Path(__file__).resolve().parents[1]


def run_bench(module: str, ckpt: Path, out: Path, *flags: str, engine: bool = True) -> dict:
    """`python -m bench.<module>` on the tiny checkpoint (on the CPU when it runs the engine); the one JSON it
    wrote under `out`."""
    device = ["--device", "cpu"] if engine else []
    cmd = [sys.executable, "-m", f"bench.{module}", "--model", str(ckpt), *device, "--out", str(out), *flags]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = out.glob(f"*-{module}.json")
    result = json.loads(path.read_text())
    assert path.name.startswith(result["date"][:10]) and result["commit"].split("-")[0][:12] in path.name
    assert result["command"] == " ".join(["python", "-m", f"bench.{module}", *cmd[3:]])
    assert result["gpu"] == ("cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name())
    assert len(result["commit"].split("-")[0]) == 40
    assert all(result["versions"][k] for k in ("python", "torch", "triton", "transformers"))
    assert result["args"]["model"] == str(ckpt)
    return result


def test_latency_records_decode_speed_ttft_and_hf_ratio(tiny_ckpt, tmp_path):
    # 96 tokens: the decode time (t_N - t_1) must outweigh the timing noise of a busy 2-core machine
    result = run_bench(
        "latency", tiny_ckpt, tmp_path, "--prompt-lens", "8", "16", "--max-tokens", "96", "--baseline", "hf"
    )
    rows = result["numbers"]["rows"]
    assert [row["prompt_len"] for row in rows] == [8, 16]
    for row in rows:
        for key in ("ttft_ms", "ms_per_step", "tok_s", "hf_ttft_ms", "hf_tok_s", "vs_hf", "roofline_tok_s"):
            assert row[key] > 0, (key, row)
        assert row["roofline_kv_tok_s"] < row["roofline_tok_s"]  # reading the context's KV costs time


def test_ab_runs_each_tree_in_turn_and_records_every_run_and_each_trees_medians(tiny_ckpt, tmp_path):
    # Two trees (this one twice; b's results named by the commit after its colon), two rounds: b, a, b, a. The
    # A/B's own file is named by the first tree's commit.
    cmd = [
        sys.executable,
        "-m",
        "bench.ab",
        "--tree",
        f"b={REPO}:{'0' * 40}",
        "--tree",
        f"a={REPO}",
        "--rounds",
        "2",
        "--out",
        str(tmp_path),
        "latency",
        "--",
        "--model",
        str(tiny_ckpt),
        "--device",
        "cpu",
        "--prompt-lens",
        "8",
        "--max-tokens",
        "16",
        "--repeats",
        "1",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob(f"*-{'0' * 12}-ab-latency.json")
    numbers = json.loads(path.read_text())["numbers"]
    assert [(run["tree"], run["round"]) for run in numbers["runs"]] == [("b", 1), ("a", 1), ("b", 2), ("a", 2)]
    assert numbers["trees"]["b"]["commit"] == "0" * 40 and numbers["trees"]["a"]["commit"] != "0" * 40
    for name in "ab":
        (row,) = numbers["medians"][name]
        steps = [run["rows"][0]["ms_per_step"] for run in numbers["runs"] if run["tree"] == name]
        assert row["prompt_len"] == 8 and row["ms_per_step"] == statistics.median(steps)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--tree", "a=.", "latency"], "give two or more"),
        (["--tree", "a=.", "--tree", "a=.", "latency"], "each name once"),
        (["--tree", "a", "--tree", "b=.", "latency"], "use NAME=DIR or NAME=DIR:COMMIT"),
        (["--tree", "a=.", "--tree", "b=/nonexistent", "latency"], "/nonexistent holds no bench/"),
        (["--tree", "a=.", "--tree", "b=.", "--rounds", "0", "latency"], "--rounds 0: use at least 1"),
        (["--tree", "a=.", "--tree", "b=.", "latency", "--", "--out", "x"], "--out after '--'"),
    ],
)
def test_ab_refuses_bad_trees_and_options(argv, message, capsys, monkeypatch):
    from bench.ab import parse_args

    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as err:
        parse_args(argv)
    assert err.value.code == 2 and message in capsys.readouterr().err


def test_throughput_records_output_tokens_per_second_beside_hf(tiny_ckpt, tmp_path):
    result = run_bench(
        "throughput",
        tiny_ckpt,
        tmp_path,
        "--num-seqs",
        "8",
        "--min-len",
        "4",
        "--max-input-len",
        "16",
        "--max-output-len",
        "8",
        "--baseline",
        "hf",
        "--hf-batch",
        "4",
    )
    ours, hf = result["numbers"]["rows"]
    assert 8 * 4 <= result["numbers"]["output_tokens"] <= 8 * 8
    assert ours["output_tok_s"] > 0 and ours["wall_s"] > 0 and ours["vs_hf"] > 0
    assert hf["output_tok_s"] > 0 and 0 < hf["padding_waste"] < 1


def test_profile_lists_the_kernels_of_decode_steps_per_batch_and_of_a_prefill_step(tiny_ckpt, tmp_path):
    result = run_bench(
        "profile",
        tiny_ckpt,
        tmp_path,
        "--batches",
        "1",
        "3",
        "--temperatures",
        "0",
        "0.7",
        "--context",
        "20",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--top",
        "8",
    )
    numbers = result["numbers"]
    assert [(d["batch"], d["temperature"], d["mode"]) for d in numbers["decode"]] == [
        (1, 0.0, "eager"),
        (3, 0.7, "eager"),
    ]
    for table in [d["kernels"] for d in numbers["decode"]] + [numbers["prefill"]["kernels"]]:
        # 8 rows and the rest: on a busy 2-core machine the matmuls ranked anywhere in the first ~6 by CPU time
        assert len(table) == 9 and table[-1]["kernel"].endswith("others)")
        assert abs(sum(row["share"] for row in table) - 1) < 1e-6
        assert any("mm" in row["kernel"] for row in table)  # the linears are there
    assert numbers["prefill"]["tokens"] == 3 * 20  # three whole prompts: as many rows as the engine has
    assert set(numbers["startup"]) == {
        "weights_s",
        "kernels_compiled",
        "compile_s",
        "kv_cache_s",
        "graph_capture_s",
        "prefill_capture_s",
        "graph_warmup_s",
        "recapture_s",
    }
    assert numbers["startup"]["recapture_s"] is None  # no graphs on the CPU


def test_critical_path_gives_each_kernel_its_end_less_the_one_befores_and_names_a_layers_repeats():
    # Two steps of two layers, each layer G, D, G (a GEMV twice, attention once): the second G starts before D
    # ends (PDL), so its share is less than its duration.
    def step(t0: float) -> list[tuple[str, float, float]]:
        kernels, t = [("embed", t0, t0 + 2)], t0 + 2
        for _ in range(2):
            kernels += [("G", t, t + 3), ("D", t + 3, t + 8), ("G", t + 6, t + 10)]
            t += 10
        return kernels

    rows = {r["kernel"]: r for r in critical_path(step(0) + step(100), steps=2, layers=2)}
    assert set(rows) == {"embed", "G #1", "G #2", "D"}
    assert rows["G #2"]["share_us_per_step"] == 2 * 2 and rows["G #2"]["us_per_step"] == 2 * 4
    assert rows["D"]["share_us_per_step"] == 2 * 5 and rows["G #1"]["share_us_per_step"] == 2 * 3
    assert rows["embed"]["share_us_per_step"] == 2 and rows["D"]["calls_per_step"] == 2
    assert sum(r["share_us_per_step"] for r in rows.values()) == 22  # the step's span, end to end
    with pytest.raises(ValueError, match="9 kernels are not 2 steps of the same kernels"):
        critical_path(step(0) + step(100)[:2], steps=2, layers=2)


def test_critical_path_charges_the_wait_after_an_input_copy_to_the_host_not_the_next_kernel():
    # Each step: the inputs' copy (1 µs), 50 µs of host launch, then two kernels; the step's 56 µs split as
    # copy 1 + host 50 + 2 + 3 (the second kernel's 1 µs gap after the first stays its own: a dependency).
    def step(t0: float) -> list[tuple[str, float, float]]:
        return [("Memcpy HtoD (Pinned -> Device)", t0, t0 + 1), ("embed", t0 + 51, t0 + 53), ("G", t0 + 54, t0 + 56)]

    rows = {r["kernel"]: r for r in critical_path(step(0) + step(100), steps=2, layers=1)}
    assert rows[HOST_GAP]["share_us_per_step"] == 50 and rows[HOST_GAP]["calls_per_step"] == 1
    assert rows["embed"]["share_us_per_step"] == 2 and rows["G"]["share_us_per_step"] == 3
    assert sum(r["share_us_per_step"] for r in rows.values()) == 56


def test_startup_places_the_workers_marks_on_the_launchs_timeline(tiny_ckpt, tmp_path):
    numbers = run_bench("startup", tiny_ckpt, tmp_path)["numbers"]
    marks = [
        numbers[f"{m}_at_s"]
        for m in ("worker_entered", "torch_imported", "device_selected", "worker_ready", "engine_ready")
    ]
    assert 0 < marks[0] and marks == sorted(marks)
    assert 0 < numbers["tokenizer_loaded_at_s"] <= marks[-1]
    assert marks[-1] <= numbers["import_s"] + numbers["engine_ready_s"] <= numbers["launch_to_first_token_s"]
    assert numbers["graph_capture_s"] >= numbers["graph_warmup_s"] == 0.0  # no graphs on the CPU


def test_startup_cold_launches_twice_in_fresh_processes_and_records_both(tiny_ckpt, tmp_path):
    result = run_bench("startup", tiny_ckpt, tmp_path, "--cold", "--prompt-len", "4")
    cold, warm = result["numbers"]["rows"]
    assert (cold["start"], warm["start"]) == ("cold", "warm")
    for row in (cold, warm):  # each a whole launch: its totals, the worker's parts and its clock marks
        assert 0 < row["worker_entered_at_s"] < row["worker_ready_at_s"] <= row["launch_to_first_token_s"]
        assert row["kernels_compiled"] == 0 and row["graph_warmup_s"] == 0.0  # no graphs on the CPU
    assert result["args"]["cold"] and result["args"]["prompt_len"] == 4


def test_frontend_records_the_host_cost_per_token_of_both_detokenizers(tiny_ckpt, tmp_path):
    rows = run_bench("frontend", tiny_ckpt, tmp_path, "--rows", "4", "--steps", "8", engine=False)["numbers"]["rows"]
    assert [r["detokenizer"] for r in rows] == [
        "IncrementalDetokenizer (windowed decode)",
        "make_detokenizer -> StreamDetokenizer",
    ]
    assert all(r["us_per_token"] > 0 for r in rows)


def test_serving_records_each_levels_speed_latencies_and_the_cpu_of_each_process(tiny_ckpt, tmp_path):
    # One stream per client process: level 2 runs two clients, whose results and CPU add up.
    result = run_bench(
        "serving",
        tiny_ckpt,
        tmp_path,
        "--concurrency",
        "1",
        "2",
        "--prompt-len",
        "8",
        "--output-len",
        "4",
        "--rounds",
        "2",
        "--client-streams",
        "1",
    )
    rows = result["numbers"]["rows"]
    assert [(r["concurrency"], r["requests"], r["client_procs"]) for r in rows] == [(1, 2, 1), (2, 4, 2)]
    for row in rows:
        assert row["output_tok_s"] > 0 and 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        # Every process of the server was found; the CPU engine's worker did the most work (a 10 ms clock tick
        # may leave the scheduler's short share at 0).
        cpu = {k: v for k, v in row.items() if k.endswith("_cpu")}
        assert set(cpu) == {"frontend_cpu", "scheduler_cpu", "worker0_cpu", "client_cpu"}, cpu
        assert min(cpu.values()) >= 0 and cpu["worker0_cpu"] == max(cpu.values()) > 0, cpu


def test_serving_level_raises_a_client_processs_failure_instead_of_waiting_for_it():
    from bench import serving

    with socket.socket() as sock:  # a port nothing listens on: every request fails to connect
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    args = serving.parse_args(["--client-streams", "1", "--request-timeout", "5"])
    with pytest.raises(RuntimeError, match="a client process failed: ConnectError"):
        serving.run_level(url, [[1, 2, 3]] * 2, 2, args, {})


def test_roofline_counts_every_parameter_of_the_model(tiny_ckpt):
    tiny = config_from_dir(tiny_ckpt)
    hf = Qwen2ForCausalLM.from_pretrained(tiny_ckpt)
    assert param_count(tiny) == sum(p.numel() for p in hf.parameters())
    _, qwen = short_model("qwen2.5-1.5b")
    with torch.device("meta"):
        hf = Qwen2ForCausalLM(hf_config(qwen))
    assert param_count(qwen) == sum(p.numel() for p in hf.parameters())
    roof = roofline(qwen, "bfloat16", 4.24)  # shared/anchors/README.md: 3.087 GB, 0.728 ms, ~1373 tok/s
    assert round(roof["weight_gb"], 3) == 3.087 and round(roof["roofline_ms"], 3) == 0.728


def test_an_fp8_kv_cache_halves_the_rooflines_kv_time_and_its_flag_reaches_the_engine():
    _, qwen = short_model("qwen2.5-1.5b")
    bf16, fp8 = (roofline(qwen, "bfloat16", 4.24, 32768, kv_cache_dtype=kv) for kv in (None, "fp8"))
    assert fp8["roofline_kv_ms"] - fp8["roofline_ms"] == pytest.approx(
        (bf16["roofline_kv_ms"] - bf16["roofline_ms"]) / 2
    )
    args = common.engine_parser("test").parse_args(["--kv-cache-dtype", "fp8"])
    assert common.engine_kwargs(args)["kv_cache_dtype"] == "fp8" and "--kv-cache-dtype" in common.engine_flags(args)


def test_engine_flags_pass_block_size_on_and_leave_unset_options_to_the_engine():
    parser = common.engine_parser("test")
    assert "block_size" not in common.engine_kwargs(parser.parse_args([]))
    args = parser.parse_args(["--block-size", "64", "--enforce-eager"])
    kwargs = common.engine_kwargs(args)
    assert kwargs["block_size"] == 64 and kwargs["enforce_eager"] is True
    flags = common.engine_flags(args)
    assert flags[flags.index("--block-size") + 1] == "64" and "--enforce-eager" in flags


def test_bench_commit_names_the_results_where_set_and_git_head_otherwise(monkeypatch):
    monkeypatch.setenv("BENCH_COMMIT", "0123abc")
    assert common.git_commit() == "0123abc"
    monkeypatch.delenv("BENCH_COMMIT")
    assert (
        common.git_commit().split("-")[0]
        == subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=common.REPO_DIR, capture_output=True, text=True, check=True
        ).stdout.strip()
    )


def run_kernels(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.kernels", *flags], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_kernel_bench_refuses_bad_cases_and_says_it_needs_a_gpu(tmp_path):
    bad = run_kernels("--attention", "1:40")
    assert bad.returncode == 2 and "'1:40' is not batch:context:max_model_len" in bad.stderr
    assert run_kernels("--attention", "1:64:32").returncode == 2  # context over max_model_len
    assert run_kernels("--rows", "0").returncode == 2
    if not torch.cuda.is_available():
        proc = run_kernels("--out", str(tmp_path))
        assert proc.returncode == 1 and "needs a CUDA GPU" in proc.stderr and not list(tmp_path.iterdir())


@pytest.mark.gpu
def test_kernel_bench_times_every_linear_and_each_attention_case(tmp_path):
    proc = run_kernels("--rows", "1", "2", "--attention", "2:40:256", "1:100:4096", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("*-kernels.json")
    numbers = json.loads(path.read_text())["numbers"]
    folds = {
        "qkv": ("-", "norm"),
        "o_proj": ("-",),
        "gate_up": ("-", "swiglu", "norm+swiglu"),
        "down": ("-",),
        "lm_head": ("-",),
    }
    assert [(r["linear"], r["fold"], r["rows"]) for r in numbers["linears"]] == [
        (name, fold, m) for name, names in folds.items() for fold in names for m in (1, 2)
    ]
    assert all(r["unfused_us"] > 0 and r["chosen_us"] > 0 for r in numbers["linears"])
    assert [(r["batch"], r["context"], r["max_model_len"]) for r in numbers["attention"]] == [
        (2, 40, 256),
        (1, 100, 4096),
    ]
    assert all(r["us"] > 0 for r in numbers["attention"])


def test_gpu_tests_records_modules_that_failed_or_skipped_at_collection(tmp_path):
    # A GPU image may lack a CPU-side test's client package: its module's error must reach the result JSON.
    (tmp_path / "test_broken.py").write_text("import not_a_package_here\n")
    (tmp_path / "test_fine.py").write_text("import pytest\n\n@pytest.mark.gpu\ndef test_one():\n    pass\n")
    skip = "import pytest\n\npytest.skip('no second GPU', allow_module_level=True)\n"
    (tmp_path / "test_skipped.py").write_text(skip)
    plugin = _Outcomes()
    code = pytest.main(
        ["-q", "-p", "no:cacheprovider", "--continue-on-collection-errors", "--rootdir", str(tmp_path), str(tmp_path)],
        plugins=[plugin],
    )
    assert code != 0 and plugin.outcomes == {"test_fine.py::test_one": "passed", "test_skipped.py": "skipped"}
    ((module, error),) = plugin.collect_errors.items()
    assert module.endswith("test_broken.py") and "not_a_package_here" in error
