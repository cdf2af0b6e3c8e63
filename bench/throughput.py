"""Offline throughput, nano-vllm's recipe: 256 sequences, input and output lengths uniform in [100, 1024],
random token ids, seed 0, ignore_eos; output tokens/s over the wall time of one generate, prefill included.

    python -m bench.throughput --baseline hf --hf-batch 64
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from bench.common import engine_parser, print_table, random_ids, record, start_engine
from frontend.model_resolution import resolve_model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = engine_parser(__doc__.splitlines()[0])
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100, help="shortest input and output")
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.6, help="nano-vllm's; 0 is greedy")
    p.add_argument("--baseline", choices=["hf"], default=None, help="also run Hugging Face generate")
    p.add_argument("--hf-batch", type=int, default=64, help="sequences per left-padded HF generate")
    p.add_argument(
        "--hf-num-seqs",
        type=int,
        default=None,
        help="run HF on only the first N sequences of the same workload (its host-bound steps are slow)",
    )
    args = p.parse_args(argv)
    if not 1 <= args.min_len <= min(args.max_input_len, args.max_output_len):
        p.error(f"--min-len {args.min_len}: use 1..min(--max-input-len, --max-output-len)")
    return args


def workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    """Prompts, then output lengths, drawn in nano-vllm's order from one seeded generator."""
    rng = random.Random(args.seed)
    prompts = [random_ids(rng, rng.randint(args.min_len, args.max_input_len), vocab) for _ in range(args.num_seqs)]
    outputs = [rng.randint(args.min_len, args.max_output_len) for _ in range(args.num_seqs)]
    return prompts, outputs


def run_ours(args: argparse.Namespace, prompts: list[list[int]], outputs: list[int]) -> dict:
    from frontend import SamplingParams

    params = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True) for n in outputs]
    with start_engine(args, max_model_len=args.max_input_len + args.max_output_len) as llm:
        llm.generate(prompts[:16], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        stats = llm.stats()
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    if generated != sum(outputs):
        raise RuntimeError(f"the engine generated {generated} tokens, not the {sum(outputs)} asked (ignore_eos)")
    return {
        "wall_s": wall,
        "output_tok_s": generated / wall,
        "total_tok_s": (generated + sum(map(len, prompts))) / wall,
        "num_preemptions": stats.get("num_preemptions"),
    }


def run_hf(
    args: argparse.Namespace, prompts: list[list[int]], outputs: list[int], config, model_path: str | None
) -> dict:
    """Batches in input order; each runs to its longest output, so padding and overrun are wasted work."""
    from bench.hf import hf_generate, load_hf_model

    model = load_hf_model(args, config, model_path)
    hf_generate(model, prompts[:2], 8, args.temperature)  # warm-up
    wall, computed = 0.0, 0
    for i in range(0, len(prompts), args.hf_batch):
        batch, wanted = prompts[i : i + args.hf_batch], outputs[i : i + args.hf_batch]
        start = time.perf_counter()
        width = hf_generate(model, batch, max(wanted), args.temperature)
        wall += time.perf_counter() - start
        computed += len(batch) * (width + max(wanted))
    useful = sum(map(len, prompts)) + sum(outputs)
    return {
        "wall_s": wall,
        "output_tok_s": sum(outputs) / wall,
        "total_tok_s": useful / wall,
        "padding_waste": 1 - useful / computed,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config, model_path = resolve_model(args.model, args.load_format)
    prompts, outputs = workload(args, config.vocab_size)
    rows = [{"engine": "pico-vllm", **run_ours(args, prompts, outputs)}]
    if args.baseline == "hf":
        rows.append(
            {
                "engine": f"hf (batch {args.hf_batch}, {args.hf_num_seqs or args.num_seqs} seqs)",
                **run_hf(args, prompts[: args.hf_num_seqs], outputs[: args.hf_num_seqs], config, model_path),
            }
        )
        rows[0]["vs_hf"] = rows[0]["output_tok_s"] / rows[1]["output_tok_s"]
    print_table(
        f"throughput: {args.num_seqs} seqs, inputs {sum(map(len, prompts))} tokens, outputs "
        f"{sum(outputs)} tokens, {args.model}"
        + (" (padding_waste: HF's share of computed tokens that were padding or overrun)" if args.baseline else ""),
        rows,
    )
    name = "throughput" + ("-fp8" if args.quantization else "")
    name += "-fp8-kv" if args.kv_cache_dtype not in (None, "auto") else ""
    name += "-spec" if args.speculative_config else ""
    record(name, args, {"rows": rows, "input_tokens": sum(map(len, prompts)), "output_tokens": sum(outputs)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
