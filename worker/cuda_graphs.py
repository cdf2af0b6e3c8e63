"""Decode steps captured as CUDA graphs, one per batch size; a batch replays the smallest size that holds it.

Sizes 1, 2, 4, 8, then every 8, up to the first size >= max_num_seqs (at most 512). Capture goes largest
first into one shared memory pool, so the smaller graphs reuse the largest one's memory. Padded lanes read
and write a spare dummy row, store to slot -1 (skipped) and attend to nothing (context length 0).
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from worker.input_buffers import StepBuffers

MAX_GRAPH_BATCH = 512
DecodeForward = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The captured sizes: enough to hold any batch up to max_num_seqs (or up to 512 when it is larger)."""
    candidates = [1, 2, 4] + list(range(8, MAX_GRAPH_BATCH + 1, 8))
    sizes = [s for s in candidates if s < max_num_seqs]
    return sizes + [s for s in candidates if s >= max_num_seqs][:1]


class DecodeGraphs:
    """forward(views) -> (logits, drawn tokens) captured per size over the static views StepBuffers gives it."""

    def __init__(self, sizes: list[int], buffers: StepBuffers, forward: DecodeForward, dummy_row: int,
                 warmup: DecodeForward | None = None) -> None:
        self.sizes = sorted(sizes)
        self.views = {size: buffers.decode_views(size) for size in self.sizes}
        self._forward, self._dummy_row = forward, dummy_row
        self._warmup = warmup or forward  # launches every kernel variant forward does; may be cheaper
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.warmup_s = 0.0  # of capture(): the eager warm-ups (Triton compiles, GEMV timing) before each graph

    def size_for(self, batch: int) -> int | None:
        """The smallest captured size >= batch, or None when the batch is larger than every graph."""
        i = bisect.bisect_left(self.sizes, batch)
        return self.sizes[i] if i < len(self.sizes) else None

    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in tqdm(self.sizes[::-1], desc="Capturing decode graphs", unit="graph"):
            views = self.views[size]
            self._fill_padding(views)
            started = time.perf_counter()
            self._warmup(views)  # outside the graph: compiles kernels (capture cannot load one), times GEMVs
            torch.cuda.synchronize()
            self.warmup_s += time.perf_counter() - started
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self._forward(views)
            self._graphs[size] = graph
        torch.cuda.synchronize()

    def replay(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._graphs[size].replay()
        return self._outputs[size]

    def _fill_padding(self, views: dict[str, torch.Tensor]) -> None:
        """Every lane a padded lane while capturing: nothing is stored, nothing attended."""
        views["rows"].fill_(self._dummy_row)
        views["slot_mapping"].fill_(-1)
        for name in ("positions", "context_lens", "sample_pos"):
            views[name].zero_()
