"""Prompt steps of up to PREFILL_GRAPH_MAX_TOKENS tokens as CUDA graphs of the model's pieces between attention
calls (Qwen2Model.piece), one chain of graphs per token bucket, with each layer's attention run eagerly in
between: its grid and metadata change with every step's sequences, the pieces' shapes only with the bucket.

Why: launched eagerly, a prompt step costs ~12 ms of host time whatever its size (~250 Triton and cuBLAS
launches; bench/NOTES.md, probe17), so every step under ~3,000 tokens waits on the host. Replayed, the pieces
cost a replay each and the attention its two Triton launches a layer.

A step of T tokens runs the smallest bucket B >= T: the pieces compute B rows, the attention reads and writes
the first T. Rows past T hold an earlier step's values; every piece is row-wise, so they never reach the
first T. Each bucket's pieces pass their results on through static buffers of the bucket's own (the qkv and
residual a piece leaves, the attention output the next one reads); one memory pool serves every bucket's
temporaries, which only one chain at a time uses.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm import tqdm

from worker.attention import AttentionMetadata

PREFILL_GRAPH_MAX_TOKENS = 2048  # above it a prompt step's kernels outlast its eager launch (probe17)
PREFILL_GRAPH_MIN_TOKENS = 128


def prefill_buckets(max_num_batched_tokens: int) -> list[int]:
    """Powers of two from PREFILL_GRAPH_MIN_TOKENS up to PREFILL_GRAPH_MAX_TOKENS, none above the step budget."""
    top = min(PREFILL_GRAPH_MAX_TOKENS, max_num_batched_tokens)
    buckets, size = [], PREFILL_GRAPH_MIN_TOKENS
    while size <= top:
        buckets.append(size)
        size *= 2
    return buckets


class PrefillGraphs:
    """run(input_ids, positions, meta, kv_caches) -> the model's final hidden states [T, H] for a prompt step of
    T <= max(buckets) tokens; after capture(graphs=False) the same flow runs its pieces eagerly (CPU tests)."""

    def __init__(self, model: torch.nn.Module, buckets: list[int], dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.buckets = model, sorted(buckets)
        c = model.config
        self.ids = torch.zeros(self.buckets[-1], dtype=torch.int64, device=device)
        attn_width, self._qkv_width = model.layers[0].self_attn.sizes[0], sum(model.layers[0].self_attn.sizes)
        new = lambda b, width: torch.zeros(b, width, dtype=dtype, device=device)  # noqa: E731
        # Per bucket: the attention output a piece reads, and the qkv (hidden, after the last) and residual it
        # leaves.
        self._attn = {b: new(b, attn_width) for b in self.buckets}
        self._qkv = {b: new(b, max(self._qkv_width, c.hidden_size)) for b in self.buckets}
        self._residual = {b: new(b, c.hidden_size) for b in self.buckets}
        self._pieces: dict[int, list] = {}  # bucket -> a callable per piece: a graph's replay, or the piece itself

    def bucket_for(self, tokens: int) -> int | None:
        """The smallest bucket that holds a step of `tokens` tokens, or None when none does."""
        return next((b for b in self.buckets if b >= tokens), None)

    def capture(self, graphs: bool) -> None:
        """Record every bucket's pieces (largest bucket first), each run once eagerly before (kernel compiles).
        graphs=False keeps the pieces as plain calls: the same buffers and flow without CUDA graphs."""
        pool = torch.cuda.graph_pool_handle() if graphs else None
        n = len(self.model.layers)
        for b in tqdm(self.buckets[::-1], desc="Capturing prefill graphs", unit="bucket", disable=not graphs):
            pieces = []
            for i in range(n + 1):
                piece = self._piece_fn(b, i, n)
                piece()
                if graphs:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        piece()
                    piece = graph.replay
                pieces.append(piece)
            self._pieces[b] = pieces
        if graphs:
            torch.cuda.synchronize()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            kv_caches: list) -> torch.Tensor:
        t = input_ids.shape[0]
        b = self.bucket_for(t)
        self.ids[:t].copy_(input_ids)
        pieces = self._pieces[b]
        pieces[0]()
        for i, kv_cache in enumerate(kv_caches):
            qkv = self._qkv[b][:t, :self._qkv_width]
            self._attn[b][:t].copy_(self.model.attend(i, qkv, positions, kv_cache, meta))
            pieces[i + 1]()
        return self._qkv[b][:t, :self.model.config.hidden_size]

    def _piece_fn(self, b: int, i: int, n: int) -> Callable[[], None]:
        """Piece i of bucket b over the bucket's static buffers: its inputs read, its outputs copied in."""
        def piece() -> None:
            x = self.ids[:b] if i == 0 else self._attn[b]
            residual = None if i == 0 else self._residual[b]
            out, new_residual = self.model.piece(i, n, x, residual)
            self._qkv[b][:, :out.shape[1]].copy_(out)
            if new_residual is not None:
                self._residual[b].copy_(new_residual)
        return piece
