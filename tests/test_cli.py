"""launch.py's command line: vLLM's flag names, EngineConfig's defaults, clear errors, mode dispatch."""

from __future__ import annotations

import importlib.util
import inspect
import os
import socket
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from frontend import cli
from frontend.server import ServerOptions
from protocol.config import EngineConfig

REPO = Path(__file__).resolve().parent.parent
VLLM_SERVE_FLAGS = [
    "--served-model-name",
    "--max-model-len",
    "--gpu-memory-utilization",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--block-size",
    "--enforce-eager",
    "--load-format",
    "--dtype",
    "--seed",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--tensor-parallel-size",
    "--api-key",
    "--trace-dir",
    "--host",
    "--port",
]
OUR_FLAGS = [
    "--device",
    "--num-kv-blocks",
    "--max-waiting-requests",
    "--step-timeout",
    "--shutdown-timeout",
    "--prompt",
    "--max-tokens",
    "--temperature",
    "--headless",
    "--engine-address",
]


def test_defaults_are_engine_config_and_server_options_defaults(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    config, options = cli.parse_args(["--model", "m"])
    assert config == EngineConfig(model="m", max_num_batched_tokens=2048)  # the one serving default of its own
    assert options == ServerOptions()
    assert (options.host, options.port) == ("127.0.0.1", 8000)


def test_every_flag_sets_its_field():
    config, options = cli.parse_args(
        [
            "--model",
            "qwen2.5-0.5b",
            "--served-model-name",
            "a",
            "b",
            "--max-model-len",
            "2048",
            "--gpu-memory-utilization",
            "0.5",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "512",
            "--block-size",
            "32",
            "--enforce-eager",
            "--load-format",
            "dummy",
            "--dtype",
            "float16",
            "--seed",
            "7",
            "--no-enable-prefix-caching",
            "--tensor-parallel-size",
            "2",
            "--api-key",
            "k",
            "--trace-dir",
            "/tmp/t",
            "--device",
            "cpu",
            "--num-kv-blocks",
            "64",
            "--max-waiting-requests",
            "10",
            "--step-timeout",
            "3.5",
            "--host",
            "0.0.0.0",
            "--port",
            "9001",
            "--shutdown-timeout",
            "2",
        ]
    )
    assert config == EngineConfig(
        model="qwen2.5-0.5b",
        max_model_len=2048,
        gpu_memory_utilization=0.5,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        block_size=32,
        enforce_eager=True,
        load_format="dummy",
        dtype="float16",
        seed=7,
        enable_prefix_caching=False,
        tensor_parallel_size=2,
        trace_dir="/tmp/t",
        device="cpu",
        num_kv_blocks=64,
        max_waiting_requests=10,
        step_timeout=3.5,
    )
    assert options == ServerOptions(
        host="0.0.0.0", port=9001, served_model_name=["a", "b"], api_key="k", shutdown_timeout=2.0
    )


def test_every_engine_config_field_has_a_flag():
    dests = {a.dest for a in cli.build_parser()._actions}
    settable = {f.name for f in fields(EngineConfig)} - {
        "model_path",
        "model_config",
        "tokenizer_dir",
    }  # filled at launch
    assert settable <= dests


def test_api_key_defaults_to_the_environment(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert cli.parse_args(["--model", "m"])[1].api_key == "from-env"
    assert cli.parse_args(["--model", "m", "--api-key", "flag"])[1].api_key == "flag"


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--block-size", "7"], "--block-size 7"),
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5"),
        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization 0.0"),
        (["--max-num-seqs", "0"], "--max-num-seqs 0"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens 0"),
        (["--max-model-len", "0"], "--max-model-len 0"),
        (["--num-kv-blocks", "1"], "--num-kv-blocks 1"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size 0"),
        (["--max-waiting-requests", "0"], "--max-waiting-requests 0"),
        (["--step-timeout", "0"], "--step-timeout 0.0"),
        (
            ["--tensor-parallel-size", "4", "--nnodes", "3"],
            "--nnodes 3 is invalid: use a divisor of --tensor-parallel-size 4",
        ),
        (["--node-rank", "1"], "--node-rank 1"),
        (["--master-port", "70000"], "--master-port 70000"),
        (["--port", "eighty"], "--port"),
        (["--port", "70000"], "--port 70000"),
        (["--port", "-1"], "--port -1"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout -1.0"),
        (["--seed", "-1"], "--seed -1"),
        (["--max-tokens", "-3"], "--max-tokens -3"),
        (["--max-tokens", "0"], "--max-tokens 0"),
        (["--temperature", "-1"], "--temperature -1.0"),
        (["--temperature", "nan"], "--temperature nan"),
    ],
)
def test_bad_value_exits_with_usage_naming_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["--model", "m", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: launch.py" in err and named in err
    assert "_" not in err.splitlines()[0], err  # the flag, never the Python argument (max_tokens=)


def test_a_bad_prompt_value_is_refused_before_any_process_starts(tiny_ckpt, monkeypatch, capsys):
    """--max-tokens and --temperature used to be checked by SamplingParams after the engine had loaded."""
    monkeypatch.setattr(cli, "run_prompt", lambda *a: pytest.fail("the engine was started"))
    for flag, value in (("--max-tokens", "-3"), ("--temperature", "-1")):
        with pytest.raises(SystemExit) as exc:
            cli.main(["--model", str(tiny_ckpt), "--device", "cpu", "--prompt", "hi", flag, value])
        assert exc.value.code == 2
        assert f"launch.py: error: {flag} {float(value) if flag == '--temperature' else value} is invalid" in (
            capsys.readouterr().err
        )


def test_a_usage_error_comes_before_the_usage_block(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--model", "m", "--dtype", "fp8"])
    first, *rest = capsys.readouterr().err.splitlines()
    assert (
        first.startswith("launch.py: error: argument --dtype: invalid choice: 'fp8'") and "usage: launch.py" in rest[1]
    )


def test_help_lists_the_choices_and_engine_config_takes_each():
    help_text = cli.build_parser().format_help()
    for flag, choices in cli._CHOICES.items():
        assert f"{flag} {{{','.join(choices)}}}" in help_text
        for choice in choices:
            EngineConfig(model="m", **{flag[2:].replace("-", "_"): choice})
    assert set(cli._CHOICES) >= {"--load-format", "--dtype", "--device"}


def test_llm_keywords_are_engine_config_fields_with_their_defaults_and_types():
    from frontend import LLM

    params = dict(inspect.signature(LLM).parameters)
    assert params.pop("model").default is inspect.Parameter.empty
    # allow_remote_shutdown is a headless engine's: the engine LLM starts is private to it
    unset = ("model", "model_path", "model_config", "tokenizer_dir", "allow_remote_shutdown")
    settable = [f for f in fields(EngineConfig) if f.name not in unset]
    assert [(p.name, p.default, p.annotation, p.kind) for p in params.values()] == [
        (f.name, f.default, f.type, inspect.Parameter.KEYWORD_ONLY) for f in settable
    ]
    assert all(f.name in LLM.__doc__ for f in settable)


def _one_line_failure(argv: list[str], env: dict[str, str] | None = None) -> str:
    """Run launch.py as a user would; its stderr must be one error line, no traceback; that line."""
    out = subprocess.run(
        [sys.executable, "launch.py", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("launch.py: error: "), out.stderr[-3000:]
    return lines[0]


@pytest.mark.skipif(
    bool(importlib.util.find_spec("torch")) and __import__("torch").cuda.device_count() > 0,
    reason="this machine has a CUDA GPU",
)
def test_device_cuda_without_a_gpu_is_one_line_before_any_process_starts(tiny_ckpt):
    line = _one_line_failure(["--model", str(tiny_ckpt), "--device", "cuda", "--prompt", "hi"])
    assert "--device 'cuda' but torch sees no CUDA GPU" in line and "--device 'cpu'" in line


def test_a_model_that_cannot_be_found_is_one_line(tmp_path):
    assert "is not a directory" in _one_line_failure(["--model", str(tmp_path / "missing"), "--prompt", "hi"])
    line = _one_line_failure(["--model", "no-such-org/no-such-model", "--prompt", "hi"], {"HF_HUB_OFFLINE": "1"})
    assert "HF_HUB_OFFLINE is set" in line and "unset HF_HUB_OFFLINE" in line and "--load-format 'dummy'" in line


def test_the_hf_hub_offline_hint_is_given_only_when_it_is_set(monkeypatch):
    import huggingface_hub

    from frontend.model_resolution import resolve_model

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ValueError) as exc:
        resolve_model("no-such-org/no-such-model")
    assert "HF_HUB_OFFLINE" not in str(exc.value) and "no network" in str(exc.value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as exc:
        resolve_model("no-such-org/no-such-model")
    assert "unset HF_HUB_OFFLINE" in str(exc.value)


def test_llm_errors_name_the_python_argument_not_the_flag(tiny_ckpt, monkeypatch):
    from frontend import LLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for kwargs, named in [
        ({"model": "no-such-org/no-such-model"}, "load_format='dummy'"),
        ({"model": str(tiny_ckpt), "max_model_len": 99999}, "max_model_len=99999"),
        ({"model": str(tiny_ckpt), "block_size": 7}, "block_size=7"),
    ]:
        with pytest.raises(ValueError) as exc:
            LLM(**kwargs)
        assert named in str(exc.value) and "--" not in str(exc.value)


def test_model_is_required(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args([])
    assert "--model" in capsys.readouterr().err


def test_help_groups_and_explains_every_flag():
    out = subprocess.run([sys.executable, "launch.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for group in (
        "model:",
        "engine and KV cache:",
        "HTTP server:",
        "one prompt, no server:",
        "headless engine, no HTTP:",
    ):
        assert group in out.stdout
    for flag in VLLM_SERVE_FLAGS + OUR_FLAGS:
        assert flag in out.stdout, flag


def test_help_names_every_family_short_name_and_architecture_resolution_runs():
    from frontend.model_resolution import families, short_model
    from protocol.config import ARCHITECTURES

    out = subprocess.run(
        [sys.executable, "launch.py", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "2000"},  # no wrapping: argparse breaks lines at hyphens
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:") and "Qwen2.5" in out.stdout and "Llama 3" in out.stdout
    for family, names in families().items():
        assert f"{family}: {', '.join(names)}" in out.stdout
    assert all(architecture in out.stdout for architecture in ARCHITECTURES)
    # The help's registry is resolution's: every family it names runs, and every architecture we run has a family.
    shown = {short_model(name)[1].architecture for names in families().values() for name in names}
    assert shown == set(ARCHITECTURES)


@pytest.mark.parametrize(
    "argv, mode",
    [
        ([], "server"),
        (["--prompt", "hi", "--max-tokens", "3"], "prompt"),
        (["--headless", "--engine-address", "tcp://:5555"], "headless"),
    ],
)
def test_main_dispatches_to_one_mode(argv, mode, monkeypatch):
    calls = []
    monkeypatch.setattr(cli, "run_server", lambda config, options: calls.append(("server", options)) or 0)
    monkeypatch.setattr(cli, "run_headless", lambda config, addr: calls.append(("headless", addr)) or 0)
    monkeypatch.setattr(cli, "run_prompt", lambda config, *a: calls.append(("prompt", a)) or 0)
    monkeypatch.setattr(cli, "check_port_free", lambda host, port, flags: None)  # port 8000 may be busy on this machine
    assert cli.main(["--model", "m", *argv]) == 0
    assert [c[0] for c in calls] == [mode]
    if mode == "prompt":
        assert calls[0][1] == ("hi", 3, 0.0)
    if mode == "headless":
        assert calls[0][1] == "tcp://:5555"


def test_a_model_that_cannot_serve_the_length_exits_2_before_starting(tiny_ckpt, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--model", str(tiny_ckpt), "--device", "cpu", "--max-model-len", "99999"])
    assert exc.value.code == 2
    assert "--max-model-len 99999 is over" in capsys.readouterr().err


def test_an_unwritable_trace_dir_exits_2_before_starting(tiny_ckpt, tmp_path, capsys):
    """It used to run the whole prompt and then die in a traceback when the trace was written."""
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit) as exc:
        cli.main(
            [
                "--model",
                str(tiny_ckpt),
                "--device",
                "cpu",
                "--trace-dir",
                str(tmp_path / "a-file" / "t"),
                "--prompt",
                "hi",
            ]
        )
    assert exc.value.code == 2
    assert "--trace-dir '" in capsys.readouterr().err


def test_a_port_in_use_exits_2_before_the_engine_starts(monkeypatch, capsys):
    import frontend.server

    monkeypatch.setattr(frontend.server, "run_server", lambda *a: pytest.fail("the engine was started"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exc:
            cli.main(["--model", "m", "--port", str(port)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--port {port}" in err and "in use" in err


def test_a_headless_tcp_engine_address_in_use_exits_2_before_the_engine_starts(monkeypatch, capsys):
    """The scheduler used to die of a ZMQError traceback in its own process, and launch.py exited 1."""
    import frontend.launcher

    monkeypatch.setattr(frontend.launcher, "run_headless", lambda *a: pytest.fail("the engine was started"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(SystemExit) as exc:
            cli.main(["--model", "m", "--headless", "--engine-address", address])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--engine-address {address}" in err and "in use" in err
