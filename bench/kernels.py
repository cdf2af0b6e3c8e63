"""Decode kernels at a model's shapes, each timed in a CUDA graph as a decode step runs it: every layer linear
at a few row counts, alone and with the norm or SwiGLU before it folded in: the unfused path (cuBLAS alone, or
that op's kernel then linear()'s pick) beside what worker.linear picks, and paged decode attention at
(batch, context, max_model_len) cases, max_model_len setting the grid as in the engine's graphs. One device
call checks a kernel change before the engine's A/B (bench/PERF.md). With --fp8, the layers' linears again with
FP8 weights (per output channel, or Qwen's 128 x 128 blocks), once per scaled_mm variant of worker/linear.py
(SCALED_MM): the unfused time past 16 rows is that variant's, so the rows 32..256 pick FP8_GEMM.

    python -m bench.kernels --rows 1 8 --attention 1:32:32768 256:512:2048
    python -m bench.kernels --rows 1 4 16 64 128 256 --attention 1:32:32768 --fp8 channel
"""

from __future__ import annotations

import argparse
import functools

from bench.common import RESULTS_DIR, print_table, record
from frontend.model_resolution import resolve_model
from protocol.config import ModelConfig

# (batch, context, max_model_len): batch 1 in the latency engine's 32K grid; batches 2 and 4 there, the largest
# the few-rows launch takes; the throughput recipe's.
ATTENTION_CASES = [
    (1, 32, 32768),
    (1, 4096, 32768),
    (1, 32640, 32768),
    (2, 8192, 32768),
    (4, 640, 32768),
    (4, 8192, 32768),
    (64, 640, 32768),
    (256, 512, 2048),
    (256, 1024, 2048),
]


def attention_case(text: str) -> tuple[int, int, int]:
    """'batch:context:max_model_len' -> three positive ints, context <= max_model_len."""
    try:
        batch, context, max_len = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not batch:context:max_model_len, e.g. 1:32:32768") from None
    if min(batch, context, max_len) < 1 or context > max_len:
        raise argparse.ArgumentTypeError(f"{text!r}: use positive numbers with context <= max_model_len")
    return batch, context, max_len


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="qwen2.5-1.5b", help="short name, Hugging Face directory or repo id")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="rows of x for every linear")
    p.add_argument(
        "--attention",
        type=attention_case,
        nargs="+",
        default=ATTENTION_CASES,
        help="decode attention cases, batch:context:max_model_len",
    )
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="fp8: the KV cache in e4m3")
    p.add_argument(
        "--fp8",
        choices=["channel", "block"],
        default=None,
        help="also time the linears with FP8 weights: a scale per output channel, or per 128 x 128 block",
    )
    p.add_argument("--out", default=str(RESULTS_DIR), help="folder the result JSON is written to")
    args = p.parse_args(argv)
    if min(args.rows) < 1:
        p.error(f"--rows {args.rows}: every row count must be 1 or more")
    return args


def linear_shapes(c: ModelConfig) -> dict[str, tuple[int, int, bool, tuple[str, ...]]]:
    """(out features, in features, has bias, the folds timed: worker.linear's "" and the ops a decode step
    folds into it) of each linear of a decode step, unsharded."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {
        "qkv": (q + 2 * kv, c.hidden_size, True, ("", "norm")),
        "o_proj": (c.hidden_size, q, False, ("",)),
        "gate_up": (2 * c.intermediate_size, c.hidden_size, False, ("", "swiglu", "norm+swiglu")),
        "down": (c.hidden_size, c.intermediate_size, False, ("",)),
        "lm_head": (c.vocab_size, c.hidden_size, False, ("",)),
    }


def fold_inputs(fold: str, rows: int, k: int) -> tuple:
    """Random bf16 CUDA inputs of worker.linear's op before (w, bias): (x,), or (x, residual, norm weight, eps)
    for a fold with the norm."""
    import torch

    rand = functools.partial(torch.randn, device="cuda", dtype=torch.bfloat16)
    if fold.startswith("norm"):
        return rand(rows, k), rand(rows, k), 1 + rand(k).abs(), 1e-6
    return (rand(rows, k),)


def time_linears(c: ModelConfig, rows: list[int], fp8_block: tuple[int, int] | None = None) -> list[dict]:
    """Each linear alone and with the ops around it folded in: the unfused path (cuBLAS; the folded ops'
    kernels around linear()'s pick) beside the one worker.linear picks; FP8 weights with fp8_block's scales
    (the layers' linears: lm_head stays bf16)."""
    import torch

    from kernels.fp8 import Fp8Weight, quantize
    from kernels.gemv import NormedInput
    from worker import linear_plan
    from worker.linear import choice, run_path

    results = []
    for name, (n, k, has_bias, folds) in linear_shapes(c).items():
        if fp8_block and name == "lm_head":
            continue
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        if fp8_block:
            w = Fp8Weight(*quantize(w, fp8_block), fp8_block)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
        for fold in folds:
            for m in rows:
                inputs = fold_inputs(fold, m, k)
                x = NormedInput.of(*inputs)[0] if fold.startswith("norm") else inputs[0]
                config = choice(fold, x, w, bias)
                op, copies = functools.partial(run_path, fold, x), linear_plan.cold_copies(w, bias)
                unfused, chosen = linear_plan.op_us(op, copies, None), linear_plan.op_us(op, copies, config)
                mb = n * k * (1 if fp8_block else 2) / 1e6  # MB per µs is TB/s
                results.append(
                    {
                        "linear": name,
                        "fold": fold or "-",
                        "rows": m,
                        "weight_mb": mb,
                        "unfused_us": unfused,
                        "chosen_us": chosen,
                        "chosen_tb_s": mb / chosen,
                        "chosen": str(config) if config else "unfused (cuBLAS)",
                    }
                )
        del w, bias
    return results


def time_attention(
    c: ModelConfig, cases: list[tuple[int, int, int]], block_size: int, kv_cache_dtype: str = "auto"
) -> list[dict]:
    import torch

    from kernels import NewTokenKV, make_cos_sin, rope_store_decode_attention
    from kernels.decode_attention import few_rows_launch
    from kernels.kv_quant import FP8_KV_DTYPE
    from worker.linear_plan import graph_us

    results = []
    for batch, context, max_len in cases:
        per_row, hkv, d = -(-context // block_size), c.num_key_value_heads, c.head_dim
        cache_dtype = FP8_KV_DTYPE if kv_cache_dtype == "fp8" else torch.bfloat16
        k_cache = torch.randn(batch * per_row, hkv, block_size, d, device="cuda").to(cache_dtype)
        v_cache = torch.randn(k_cache.shape, device="cuda").to(cache_dtype)
        tables = torch.zeros(batch, -(-max_len // block_size), dtype=torch.int32, device="cuda")
        tables[:, :per_row] = torch.randperm(batch * per_row, device="cuda").int().view(batch, per_row)
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, c.num_attention_heads, d, device="cuda", dtype=torch.bfloat16)
        # As a decode step runs it: the step's own K/V rotated and stored at position context - 1, and a few rows'
        # block tables read through their rows.
        slots = tables[:, (context - 1) // block_size].long() * block_size + (context - 1) % block_size
        new_kv = NewTokenKV(
            torch.randn_like(q[:, :hkv]),
            torch.randn_like(q[:, :hkv]),
            lens.long() - 1,
            make_cos_sin(context, d, 1e6, "cuda"),
            slots,
        )
        rows = torch.arange(batch, device="cuda") if few_rows_launch(batch, hkv) else None
        us = graph_us(
            [functools.partial(rope_store_decode_attention, q, new_kv, k_cache, v_cache, tables, lens, d**-0.5, rows)]
        )
        kv_gb = 2 * batch * context * hkv * d * k_cache.element_size() / 1e9  # K and V read
        results.append(
            {"batch": batch, "context": context, "max_model_len": max_len, "us": us, "kv_tb_s": kv_gb / us * 1e3}
        )
        del k_cache, v_cache
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench.kernels times CUDA graphs: it needs a CUDA GPU (this machine has none)")
    config, _ = resolve_model(args.model, load_format="dummy")
    numbers = {
        "linears": time_linears(config, args.rows),
        "attention": time_attention(config, args.attention, args.block_size, args.kv_cache_dtype),
    }
    print_table(f"linears of {args.model} in bf16, each in a CUDA graph over weights not in L2", numbers["linears"])
    print_table(
        f"decode attention per layer (one layer's {args.kv_cache_dtype} cache; max_model_len sets the split grid)",
        numbers["attention"],
    )
    if args.fp8:
        from kernels.fp8 import PER_CHANNEL
        from worker import linear

        block = PER_CHANNEL if args.fp8 == "channel" else (128, 128)
        for path in linear.SCALED_MM:
            linear.FP8_GEMM = path
            try:
                numbers[f"fp8_{path}"] = time_linears(config, args.rows, block)
            except RuntimeError as e:  # a variant this torch or GPU lacks must not hide the others
                print(f"FP8 path {path} failed: {e}")
                continue
            print_table(f"FP8 linears ({args.fp8} scales), unfused past 16 rows: {path}", numbers[f"fp8_{path}"])
    record("kernels" + ("-fp8-kv" if args.kv_cache_dtype == "fp8" else ""), args, numbers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
