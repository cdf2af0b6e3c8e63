"""Every CUDA graph of a runner: decode steps per batch size, prompt steps per token bucket; a step replays the
smallest that holds it. Padded lanes read and write a spare dummy row, store to slot -1 and attend to nothing."""

from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

MAX_GRAPH_BATCH = 512
# Past 2,048 tokens a prompt step's kernels outlast its eager launch; from 256 tokens a step pads by at most 1.5x.
PREFILL_GRAPH_BUCKETS = (256, 512, 768, 1024, 1536, 2048)
VERIFY_GRAPH_BUCKETS = (8, 16, 32, 64, 128)
Views = dict[str, torch.Tensor]
_PAD = {"slot_mapping": -1, "work": -1}  # fill values of a padded lane; rows take the dummy row, the rest 0


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The captured decode sizes: enough to hold any batch up to max_num_seqs (or up to 512 when it is larger)."""
    candidates = [1, 2, 4] + list(range(8, MAX_GRAPH_BATCH + 1, 8))
    return [s for s in candidates if s < max_num_seqs] + [s for s in candidates if s >= max_num_seqs][:1]


def prefill_buckets(max_num_batched_tokens: int, speculative: bool = False) -> list[int]:
    """The captured prompt-step sizes: the buckets under the step budget, then the budget itself when smaller;
    with speculative decoding, small ones too (a verify step is a few rows' drafts)."""
    top = min(PREFILL_GRAPH_BUCKETS[-1], max_num_batched_tokens)
    buckets = VERIFY_GRAPH_BUCKETS + PREFILL_GRAPH_BUCKETS if speculative else PREFILL_GRAPH_BUCKETS
    return [b for b in buckets if b < top] + [top]


class CudaGraphs:
    """forward(views) captured per kind ("decode", "prefill") and size; with graphs=False (CPU, enforce_eager,
    tests) a replay is a plain call over the same padded views."""

    def __init__(self, dummy_row: int, graphs: bool = True) -> None:
        self.dummy_row, self.graphs = dummy_row, graphs
        self.sizes: dict[str, list[int]] = {}
        self.views: dict[str, dict[int, Views]] = {}
        self._replays: dict[tuple[str, int], Callable[[], object]] = {}
        self.warmup_s = 0.0  # eager warm-ups before each capture: kernels' first launches, GEMV timing

    def capture(
        self,
        kind: str,
        views: dict[int, Views],
        forward: Callable[[Views], object],
        warmup: Callable[[Views], object] | None,
        bar: tqdm | None = None,
    ) -> None:
        """warmup: an eager run before each capture (None: the kernels are ready); bar: advanced by one per graph."""
        self.sizes[kind], self.views[kind] = sorted(views), views
        pool = torch.cuda.graph_pool_handle() if self.graphs else None
        for size in self.sizes[kind][::-1]:
            for name, view in views[size].items():
                view.fill_(self.dummy_row if name == "rows" else _PAD.get(name, 0))
            if not self.graphs:
                self._replays[kind, size] = functools.partial(forward, views[size])
                continue
            if warmup is not None:  # outside the graph: a capture cannot compile or time a kernel
                started = time.perf_counter()
                warmup(views[size])
                torch.cuda.synchronize()
                self.warmup_s += time.perf_counter() - started
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = forward(views[size])
            self._replays[kind, size] = functools.partial(_replay, graph, outputs)
            if bar is not None:
                bar.update()
        if self.graphs:
            torch.cuda.synchronize()

    def replay_or_capture(self, key: tuple[str, int], body: Callable[[], object]) -> object:
        """body's outputs: from its graph once captured; else from body run eagerly (which also compiles its kernels),
        and then captured for the calls after (graphs only), in a memory pool of its own."""
        if (replay := self._replays.get(key)) is not None:
            return replay()
        outputs = body()
        if self.graphs:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._replays[key] = functools.partial(_replay, graph, body())
        return outputs

    def size_for(self, kind: str, n: int) -> int | None:
        sizes = self.sizes.get(kind, [])
        i = bisect.bisect_left(sizes, n)
        return sizes[i] if i < len(sizes) else None

    def replay(self, kind: str, size: int) -> object:
        return self._replays[kind, size]()


def _replay(graph: torch.cuda.CUDAGraph, outputs: object) -> object:
    graph.replay()
    return outputs
