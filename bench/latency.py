"""Batch-1 decode speed and time to first token at several prompt lengths, beside the roofline (and HF).

Method (bench/PERF.md): time a generate of 1 new token (the time to first token: the
prompt's prefill and one token) and one of N new tokens; (t_N - t_1) / (N - 1) is one decode step with
the prefill taken out. A warm-up generate runs first at each length, and every call gets a fresh random
prompt, so that the prefix cache never skips a prefill.

    python -m bench.latency --baseline hf                  # qwen2.5-1.5b, dummy weights, 32/1024/32768

--workload copy gives each timed generate a prompt that holds the text it will write, for speculative decoding: a
random prompt R is continued greedily for C + N tokens (O), and the prompt is R + O[:C] (its continuation O[C:] is
then known; drafts find it when O repeats itself). The result records the drafts' acceptance per position.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Callable

from bench.common import (
    COPY_TBPS,
    dtype_name,
    engine_parser,
    print_table,
    random_ids,
    record,
    roofline,
    start_engine,
    timed,
)
from frontend.model_resolution import resolve_model

Generate = Callable[[list[int], int], object]  # (prompt ids, new tokens) -> returns when they are done


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = engine_parser(__doc__.splitlines()[0])
    p.add_argument(
        "--prompt-lens",
        type=int,
        nargs="+",
        default=[32, 1024, 32768],
        help="prompt lengths; each is cut to fit the model's length with --max-tokens",
    )
    p.add_argument("--max-tokens", type=int, default=257, help="N, the new tokens of the long generate")
    p.add_argument("--repeats", type=int, default=3, help="timed pairs per length (the median is kept)")
    p.add_argument("--hf-repeats", type=int, default=1, help="the same for the HF baseline (slow: 56 ms/step)")
    p.add_argument("--baseline", choices=["hf"], default=None, help="also run Hugging Face generate")
    p.add_argument("--copy-tbps", type=float, default=COPY_TBPS, help="copy bandwidth of the roofline")
    p.add_argument("--workload", choices=["random", "copy"], default="random", help="prompts: random, or copy-heavy")
    p.add_argument("--copy-len", type=int, default=512, help="C, the generated tokens a copy prompt holds")
    args = p.parse_args(argv)
    if args.max_tokens < 2:
        p.error(f"--max-tokens {args.max_tokens}: use at least 2 (the step time is (t_N - t_1) / (N - 1))")
    return args


def measure(
    generate: Generate, prompt_len: int, args: argparse.Namespace, vocab: int, repeats: int, prompt: Callable
) -> dict:
    """Time to first token and decode step time at one prompt length (medians of `repeats` pairs)."""
    rng = random.Random(args.seed + prompt_len)
    generate(random_ids(rng, prompt_len, vocab), min(8, args.max_tokens))  # warm-up: kernels, allocator
    firsts, longs = [], []
    for _ in range(repeats):
        firsts.append(timed(generate, prompt(rng, prompt_len), 1))
        longs.append(timed(generate, prompt(rng, prompt_len), args.max_tokens))
    t1, tn = statistics.median(firsts), statistics.median(longs)
    step = (tn - t1) / (args.max_tokens - 1)
    return {"ttft_ms": t1 * 1e3, "ms_per_step": step * 1e3, "tok_s": 1 / step if step > 0 else None}


def run_ours(args: argparse.Namespace, lens: list[int], vocab: int) -> list[dict]:
    from frontend import SamplingParams

    def generate(ids: list[int], n: int) -> object:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return llm.generate(ids, params, use_tqdm=False)

    def copy_prompt(rng: random.Random, n: int) -> list[int]:
        ids = random_ids(rng, n, vocab)
        params = SamplingParams(temperature=0, max_tokens=args.copy_len + args.max_tokens, ignore_eos=True)
        written = llm.generate(ids, params, use_tqdm=False)
        return ids + written[0].outputs[0].token_ids[: args.copy_len]

    def random_prompt(rng: random.Random, n: int) -> list[int]:
        return random_ids(rng, n, vocab)

    prompt = copy_prompt if args.workload == "copy" else random_prompt
    extra = args.copy_len if args.workload == "copy" else 0
    with start_engine(args, max_model_len=max(lens) + extra + args.max_tokens, max_num_seqs=1) as llm:
        rows = []
        for n in lens:
            before = llm.stats()
            rows.append(measure(generate, n, args, vocab, args.repeats, prompt))
            rows[-1].update(acceptance(before, llm.stats()))
        return rows


def acceptance(before: dict, after: dict) -> dict:
    """Speculative decoding over a measurement: accepted tokens per draft, and the share accepted per position."""
    if "spec_num_drafts" not in after:
        return {}
    drafts = after["spec_num_drafts"] - before["spec_num_drafts"]
    accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    per_pos = [a - b for a, b in zip(after["spec_accepted_per_pos"], before["spec_accepted_per_pos"])]
    return {
        "drafts": drafts,
        "accepted_per_draft": accepted / drafts if drafts else 0.0,
        "acceptance_per_pos": [round(n / drafts, 3) if drafts else 0.0 for n in per_pos],
    }


def run_hf(args: argparse.Namespace, lens: list[int], config, model_path: str | None) -> list[dict]:
    from bench.hf import hf_generate, load_hf_model

    model = load_hf_model(args, config, model_path)
    return [
        measure(
            lambda ids, n: hf_generate(model, [ids], n),
            length,
            args,
            config.vocab_size,
            args.hf_repeats,
            lambda rng, n: random_ids(rng, n, config.vocab_size),
        )
        for length in lens
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config, model_path = resolve_model(args.model, args.load_format)
    # Prompt + N new tokens must fit the model (32768 for Qwen2.5): the longest prompt gives way.
    lens = [min(n, config.max_position_embeddings - args.max_tokens) for n in args.prompt_lens]
    ours = run_ours(args, lens, config.vocab_size)
    hf = run_hf(args, lens, config, model_path) if args.baseline == "hf" else [{}] * len(lens)
    dtype = dtype_name(args, config)
    rows = []
    for n, mine, theirs in zip(lens, ours, hf):
        roof = roofline(
            config, dtype, args.copy_tbps, n, args.tensor_parallel_size, args.quantization, args.kv_cache_dtype
        )
        rows.append(
            {
                "prompt_len": n,
                **mine,
                "hf_ttft_ms": theirs.get("ttft_ms"),
                "hf_tok_s": theirs.get("tok_s"),
                "vs_hf": mine["tok_s"] / theirs["tok_s"] if theirs.get("tok_s") and mine["tok_s"] else None,
                "roofline_ms": roof["roofline_ms"],
                "roofline_tok_s": roof["roofline_tok_s"],
                "roofline_kv_tok_s": roof["roofline_kv_tok_s"],
                "of_roofline": mine["tok_s"] / roof["roofline_tok_s"] if mine["tok_s"] else None,
            }
        )
    name = ("latency-eager" if args.enforce_eager else "latency") + ("-fp8" if args.quantization else "")
    name += "-fp8-kv" if args.kv_cache_dtype not in (None, "auto") else ""
    name += ("-spec" if args.speculative_config else "") + ("-copy" if args.workload == "copy" else "")
    print_table(
        f"{name}: batch 1, {args.max_tokens} new tokens, {args.model} {dtype} {args.quantization or ''}, "
        f"roofline {roof['weight_gb']:.3f} GB of weights at {args.copy_tbps} TB/s "
        "(roofline_kv: + the context's KV)",
        rows,
    )
    record(name, args, {"rows": rows, "weight_gb": roof["weight_gb"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
