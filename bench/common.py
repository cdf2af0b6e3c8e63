"""What every benchmark shares: engine flags, seeded random prompts, the roofline, the result record and
the table printer."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from protocol.config import ModelConfig

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_DIR = RESULTS_DIR.parents[1]
COPY_TBPS = 4.24  # the H200's device-to-device copy, bytes read + written (bench/PERF.md)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Engine options the benchmarks pass on, under LLM(...)'s keyword names (launch.py's flags in snake_case).
ENGINE_KEYS = (
    "load_format",
    "device",
    "dtype",
    "enforce_eager",
    "tensor_parallel_size",
    "num_kv_blocks",
    "block_size",
    "max_num_batched_tokens",
    "trace_dir",
    "quantization",
    "kv_cache_dtype",
    "speculative_config",
)


def engine_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the flags every benchmark takes: the engine's (launch.py's names), --seed and --out."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="qwen2.5-1.5b", help="short name, Hugging Face directory or repo id")
    p.add_argument("--load-format", default="dummy", help="'dummy' (random weights), 'auto' or 'safetensors'")
    p.add_argument("--device", default="auto", help="'auto', 'cpu' or 'cuda'")
    p.add_argument("--dtype", default="auto", help="'auto' (the model's), 'float32', 'float16' or 'bfloat16'")
    p.add_argument("--quantization", choices=["fp8"], default=None, help="fp8: linear weights in float8 e4m3")
    p.add_argument(
        "--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default=None, help="fp8: the KV cache in float8 e4m3"
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--speculative-config", type=json.loads, default=None, help='speculative decoding: {"method": "ngram", ...}'
    )
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, help="GPUs to shard the model over")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="fix the KV cache size (default: from memory)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block (default: the engine's)")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="token budget of one step (default: the engine's)"
    )
    p.add_argument("--trace-dir", default=None, help="also write the engine's traces to this folder")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and lengths")
    p.add_argument("--out", default=str(RESULTS_DIR), help="folder the result JSON is written to")
    return p


def engine_kwargs(args: argparse.Namespace) -> dict:
    """LLM(...) keywords from the flags; options left unset stay the engine's defaults."""
    return {key: getattr(args, key) for key in ENGINE_KEYS if getattr(args, key) not in (None, False)}


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The same options as launch.py flags."""
    flags = []
    for key, value in engine_kwargs(args).items():
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


def start_engine(args: argparse.Namespace, **overrides):
    """An LLM built from the flags (imported here: the frontend loads transformers, slow to import)."""
    from frontend import LLM

    return LLM(args.model, **{**engine_kwargs(args), **overrides})


def device_name(args: argparse.Namespace) -> str:
    """'cuda' or 'cpu': what --device 'auto' picks on this machine."""
    if args.device != "auto":
        return args.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def dtype_name(args: argparse.Namespace, config: ModelConfig) -> str:
    """The dtype the engine runs (worker/model_runner.py): 'auto' is the model's on CUDA, float32 on CPU."""
    if args.dtype != "auto":
        name = args.dtype
    else:
        name = config.torch_dtype if device_name(args) == "cuda" else "float32"
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPE_BYTES)}: pass --dtype")
    return name


def random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """n random token ids in nano-vllm's bench range [0, 10000] (less for tiny test vocabularies)."""
    high = min(10000, vocab_size - 1)
    return [rng.randint(0, high) for _ in range(n)]


def timed(fn, *args) -> float:
    """Wall seconds of fn(*args); fn must return only when its work is done (generate does)."""
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def param_count(c: ModelConfig) -> int:
    """Parameters of a Qwen2 model: embeddings (+ lm_head when untied), layers with qkv bias, final norm."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = (
        (c.hidden_size + 1) * (q + 2 * kv)
        + q * c.hidden_size
        + 3 * c.hidden_size * c.intermediate_size
        + 2 * c.hidden_size
    )
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return embeddings + c.num_hidden_layers * layer + c.hidden_size


def linear_weight_count(c: ModelConfig) -> int:
    """Weights of the layers' linears (q, k, v, o, gate, up, down): what FP8 stores in one byte each."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return c.num_hidden_layers * (c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size)


def roofline(
    c: ModelConfig,
    dtype: str,
    copy_tbps: float,
    context: int = 0,
    tp: int = 1,
    quantization: str | None = None,
    kv_cache_dtype: str | None = None,
) -> dict:
    """Batch-1 decode floor: each GPU reads its weights (and, with kv, the context's K and V) once a step; with
    fp8 the linears' weights are one byte each (their scales left out: under 0.1%), with an fp8 KV cache its values."""
    fp8_saved = linear_weight_count(c) * (DTYPE_BYTES[dtype] - 1) if quantization == "fp8" else 0
    weight_bytes = (param_count(c) * DTYPE_BYTES[dtype] - fp8_saved) / tp
    kv_value_bytes = 1 if kv_cache_dtype in ("fp8", "fp8_e4m3") else DTYPE_BYTES[dtype]
    kv_bytes = context * 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * kv_value_bytes / tp
    ms = weight_bytes / (copy_tbps * 1e12) * 1e3
    kv_ms = (weight_bytes + kv_bytes) / (copy_tbps * 1e12) * 1e3
    return {
        "weight_gb": weight_bytes / 1e9,
        "roofline_ms": ms,
        "roofline_tok_s": 1e3 / ms,
        "roofline_kv_ms": kv_ms,
        "roofline_kv_tok_s": 1e3 / kv_ms,
    }


def record(name: str, args: argparse.Namespace, numbers: dict | list) -> Path:
    """Write one run as `<date>-<commit>-<name>.json` under --out; return its path."""
    now = datetime.datetime.now(datetime.timezone.utc)
    commit = git_commit()
    result = {
        "name": name,
        "commit": commit,
        "date": now.isoformat(timespec="seconds"),
        "gpu": gpu_name(),
        "versions": versions(),
        "command": command_line(),
        "args": vars(args),
        "numbers": numbers,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    short = commit.split("-")[0][:12] + ("-dirty" if commit.endswith("-dirty") else "")
    path = out / f"{now:%Y-%m-%d}-{short}-{name}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {path}")
    return path


def git_commit() -> str:
    """$BENCH_COMMIT when set (a copied tree's .git can be stale: the device's named a session-old commit),
    else HEAD's hash, '-dirty' when tracked files differ from it."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=REPO_DIR, capture_output=True, text=True, check=True).stdout

    try:
        head = git("rev-parse", "HEAD").strip()
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def versions() -> dict:
    found = {"python": platform.python_version()}
    for package in ("torch", "triton", "transformers"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def command_line() -> str:
    """How this run was started, as `python -m bench.x ...` when it was started that way."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    argv = ["python", "-m", spec.name, *sys.argv[1:]] if spec is not None else sys.argv
    return shlex.join(argv)


def print_table(title: str, rows: list[dict]) -> None:
    """Rows as aligned columns (every key of any row, in first-seen order), numbers rounded for reading."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    cells = [[_cell(row.get(col)) for col in columns] for row in rows]
    widths = [max(len(col), *(len(r[i]) for r in cells)) for i, col in enumerate(columns)]
    print(f"\n{title}")
    for line in [columns, *cells]:
        print("  ".join(value.rjust(width) for value, width in zip(line, widths)))


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3g}"
    return "-" if value is None else str(value)
