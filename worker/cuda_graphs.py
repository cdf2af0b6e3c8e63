"""Steps captured as CUDA graphs over the static views of StepBuffers; a step replays the smallest size that
holds it.

Decode graphs: one per batch size, 1, 2, 4, 8, then every 8, up to the first size >= max_num_seqs (at most
512); a few rows get a second set for short contexts, whose attention needs no tile loop (the runner's
short_context). Prefill graphs: the whole model's forward for a prompt step, one per token bucket (prefill_buckets):
launched eagerly, a prompt step costs ~12 ms of host time whatever its size (~250 Triton and cuBLAS
launches; bench/NOTES.md, probe17), so every step under ~3,000 tokens would wait on the host. The prefill
attention's grid is its list of work items, sized for the bucket (kernels/prefill_attention.py), so it does
not change with the step's sequences.

Capture goes largest first into one memory pool per kind, so the smaller graphs reuse the largest one's
memory. Padded lanes read and write a spare dummy row, store to slot -1 (skipped), attend to nothing
(context length 0, no queries, no work items), and every op of a step is row-wise outside the attention, so
they never reach the real rows.
"""
from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

MAX_GRAPH_BATCH = 512
# Above 2,048 tokens a prompt step's kernels outlast its eager launch (probe17). Steps of 256 tokens or more
# pad by at most 1.5x: a 512-token prompt beside a few decode rows takes 768, not 1,024.
PREFILL_GRAPH_BUCKETS = (256, 512, 768, 1024, 1536, 2048)
Views = dict[str, torch.Tensor]
_PAD = {"slot_mapping": -1, "work": -1}  # fill values of a padded lane; rows take the dummy row, the rest 0


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The captured decode sizes: enough to hold any batch up to max_num_seqs (or up to 512 when it is larger)."""
    candidates = [1, 2, 4] + list(range(8, MAX_GRAPH_BATCH + 1, 8))
    sizes = [s for s in candidates if s < max_num_seqs]
    return sizes + [s for s in candidates if s >= max_num_seqs][:1]


def smallest_at_least(sizes: list[int], n: int) -> int | None:
    """The smallest of the sorted `sizes` >= n, or None when n is larger than every one."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def prefill_buckets(max_num_batched_tokens: int) -> list[int]:
    """The captured prompt-step sizes: PREFILL_GRAPH_BUCKETS under the step budget, then the budget itself
    when it is under the largest (the largest step there can be)."""
    top = min(PREFILL_GRAPH_BUCKETS[-1], max_num_batched_tokens)
    return [b for b in PREFILL_GRAPH_BUCKETS if b < top] + [top]


class StepGraphs:
    """forward(views) captured per size over that size's static views; replay(size) returns its outputs.

    capture(graphs=False) keeps forward as a plain call over the same views: the graphs' flow, padding
    included, without CUDA (CPU tests).
    """

    def __init__(self, name: str, views: dict[int, Views], forward: Callable[[Views], object], dummy_row: int,
                 warmup: Callable[[Views], object] | None = None) -> None:
        self.name, self.views = name, views
        self.sizes = sorted(views)
        self._forward, self._dummy_row = forward, dummy_row
        self._warmup = warmup or forward  # launches every kernel variant forward does; may be cheaper
        self._replays: dict[int, Callable[[], object]] = {}
        self.warmup_s = 0.0  # of capture(): the eager warm-ups (Triton compiles, GEMV timing) before each graph

    def capture(self, graphs: bool = True) -> None:
        pool = torch.cuda.graph_pool_handle() if graphs else None
        for size in tqdm(self.sizes[::-1], desc=f"Capturing {self.name} graphs", unit="graph", disable=not graphs):
            views = self.views[size]
            self._fill_padding(views)
            if not graphs:
                self._replays[size] = functools.partial(self._forward, views)
                continue
            started = time.perf_counter()
            self._warmup(views)  # outside the graph: compiles kernels (capture cannot load one), times GEMVs
            torch.cuda.synchronize()
            self.warmup_s += time.perf_counter() - started
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = self._forward(views)
            self._replays[size] = functools.partial(_replay, graph, outputs)
        if graphs:
            torch.cuda.synchronize()

    def replay(self, size: int) -> object:
        return self._replays[size]()

    def _fill_padding(self, views: Views) -> None:
        """Every lane a padded lane while capturing: nothing is stored, nothing attended."""
        for name, view in views.items():
            view.fill_(self._dummy_row if name == "rows" else _PAD.get(name, 0))


def _replay(graph: torch.cuda.CUDAGraph, outputs: object) -> object:
    graph.replay()
    return outputs
