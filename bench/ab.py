"""Old and new code side by side: one benchmark run from each source tree in turn, several rounds on one machine,
one result JSON with every run and each tree's medians.

One code's engine processes spread ~1% in batch-1 decode speed on one H200, and more between machines
(bench/PERF.md), so a change of that size is told apart only by runs of both codes alternating on one machine.

    git archive 08ae508 | tar -x -C /tmp/old
    python -m bench.ab --tree new=. --tree old=/tmp/old:08ae508 --rounds 3 latency -- --prompt-lens 32 1024

Each run is `python -m bench.<benchmark> <its args> --out <scratch>` with the tree as its working directory and
first on PYTHONPATH, its own PICO_VLLM_CACHE (trees may tune different kernels) and BENCH_COMMIT set to the
tree's commit where one is given after a colon (an exported tree has no .git of its own).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import print_table, record

BENCHMARKS = ("latency", "throughput", "serving", "startup")


def parse_tree(spec: str) -> tuple[str, Path, str | None]:
    """NAME=DIR[:COMMIT] -> (name, dir, commit)."""
    name, sep, rest = spec.partition("=")
    path, _, commit = rest.partition(":")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--tree {spec!r}: use NAME=DIR or NAME=DIR:COMMIT")
    if not (Path(path) / "bench").is_dir():
        raise argparse.ArgumentTypeError(f"--tree {spec!r}: {path} holds no bench/ (a source tree of this repo?)")
    return name, Path(path).resolve(), commit or None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--tree",
        type=parse_tree,
        action="append",
        required=True,
        metavar="NAME=DIR[:COMMIT]",
        help="a source tree to run (give two or more)",
    )
    p.add_argument("--rounds", type=int, default=2, help="runs of each tree, alternating")
    p.add_argument("--cache", default=None, help="root of the trees' PICO_VLLM_CACHE dirs (default: a temp dir)")
    p.add_argument("--out", default="bench/results")
    p.add_argument("benchmark", choices=BENCHMARKS)
    args = p.parse_args(argv[:split])
    args.bench_args = argv[split + 1 :]
    names = [name for name, _, _ in args.tree]
    if len(names) < 2 or len(set(names)) != len(names):
        p.error(f"--tree names {names}: give two or more, each name once")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: use at least 1")
    if "--out" in args.bench_args:
        p.error("--out after '--': each run writes to a scratch dir; give --out before the benchmark's name")
    return args


def run_once(args: argparse.Namespace, name: str, tree: Path, commit: str | None, cache: Path) -> dict:
    """One run of the benchmark from `tree`: its result JSON."""
    with tempfile.TemporaryDirectory() as scratch:
        env = {
            **os.environ,
            "PICO_VLLM_CACHE": str(cache / name),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])),
        }
        if commit:
            env["BENCH_COMMIT"] = commit
        cmd = [sys.executable, "-m", f"bench.{args.benchmark}", *args.bench_args, "--out", scratch]
        proc = subprocess.run(cmd, cwd=tree, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"tree {name} ({tree}): {' '.join(cmd[1:])} exited {proc.returncode}")
        (path,) = Path(scratch).glob("*.json")
        return json.loads(path.read_text())


def medians(runs: list[dict]) -> list[dict]:
    """Row by row over one tree's runs: each number's median; other values as the first run has them."""
    out = []
    for rows in zip(*(run["rows"] for run in runs)):
        out.append(
            {
                key: statistics.median(row[key] for row in rows)
                if all(isinstance(row.get(key), (int, float)) and not isinstance(row.get(key), bool) for row in rows)
                else value
                for key, value in rows[0].items()
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory() as scratch_cache:
        cache = Path(args.cache or scratch_cache)
        for round_ in range(1, args.rounds + 1):
            for name, tree, commit in args.tree:
                result = run_once(args, name, tree, commit, cache)
                numbers = result["numbers"]
                rows = numbers["rows"] if "rows" in numbers else [numbers]  # startup's numbers are one row
                runs.append({"tree": name, "round": round_, "commit": result["commit"], "rows": rows})
    trees = {
        name: {"dir": str(tree), "commit": next(r["commit"] for r in runs if r["tree"] == name)}
        for name, tree, _ in args.tree
    }
    summary = {name: medians([r for r in runs if r["tree"] == name]) for name in trees}
    for name, rows in summary.items():
        print_table(f"{name}: medians of {args.rounds} runs ({trees[name]['commit'][:12]})", rows)
    # Named by the first tree's commit (the code under test), not by the checkout that ab itself runs from.
    os.environ.setdefault("BENCH_COMMIT", trees[args.tree[0][0]]["commit"])
    args.tree = [f"{name}={tree}" + (f":{commit}" if commit else "") for name, tree, commit in args.tree]
    record(f"ab-{args.benchmark}", args, {"trees": trees, "medians": summary, "runs": runs})


if __name__ == "__main__":
    main()
