"""The worker's static input buffers: a step's arrays, written with numpy into a pinned staging buffer, reach
the device in one copy. The fields a graph reads come first, so their offsets depend on the graph's size alone
and a graph reads the same addresses on every replay; a step run by a graph is staged padded to its size."""

from __future__ import annotations

import functools

import numpy as np
import torch

from worker.attention import AttentionBackend
from worker.row_mirror import HostStep

# (name, dtype, size key)
_FIELDS = (
    ("rows", np.int64, "B"),  # mirror row of each scheduled sequence (padded lanes: the dummy row)
    ("positions", np.int64, "T"),
    ("slot_mapping", np.int64, "T"),
    ("context_lens", np.int32, "B"),
    ("cu_seqlens_q", np.int32, "B1"),
    ("input_ids", np.int64, "T"),  # prompt tokens; decode tokens are filled on the device
    ("work", np.int32, "W2"),  # prefill attention's [2, W] work items; -1: none
    ("sample_idx", np.int64, "S"),  # token index of each sampled row's last token
    ("sample_rows", np.int64, "S"),
    ("sample_pos", np.int64, "S"),  # index in its sequence of the token being sampled (seeds hash it)
    ("delta_idx", np.int64, "D"),  # flat [row * M + col] entries of the block table that change
    ("delta_val", np.int32, "D"),
)
_TORCH = {np.int64: torch.int64, np.int32: torch.int32}
_DECODE_READS = ("rows", "positions", "slot_mapping", "context_lens", "sample_pos")
_PREFILL_READS = ("rows", "positions", "slot_mapping", "context_lens", "cu_seqlens_q", "input_ids", "work")

# Triton specialises pointers on 16-byte alignment: unaligned fields made eager steps compile new variants.
FIELD_ALIGN = 16


Layout = dict[str, tuple[int, int, type]]  # field -> byte offset, byte length, dtype


@functools.lru_cache(maxsize=4096)
def _layout(tokens: int, seqs: int, samples: int, deltas: int, work: int) -> tuple[Layout, int]:
    """Byte offset, byte length and dtype of every field, and the end; each field starts FIELD_ALIGN-aligned."""
    sizes = {"T": tokens, "B": seqs, "B1": seqs + 1, "S": samples, "D": deltas, "W2": 2 * work}
    out, offset = {}, 0
    for name, dtype, key in _FIELDS:
        nbytes = sizes[key] * np.dtype(dtype).itemsize
        out[name] = (offset, nbytes, dtype)
        offset += -(-nbytes // FIELD_ALIGN) * FIELD_ALIGN
    return out, offset


class StepBuffers:
    """Two pinned host staging buffers (alternating, so one may be in flight) and one device buffer."""

    def __init__(
        self, max_tokens: int, max_seqs: int, max_deltas: int, attention: AttentionBackend, device: torch.device
    ) -> None:
        self.max_seqs, self.attention = max_seqs, attention
        work = attention.max_work_items(max_tokens, max_seqs)
        _, capacity = _layout(max_tokens, max_seqs, max_tokens, max_deltas, work)  # verify rows sample every token
        self._host = [torch.zeros(capacity, dtype=torch.uint8, pin_memory=device.type == "cuda") for _ in range(2)]
        self._host_np = [h.numpy() for h in self._host]
        self.device_buf = torch.zeros(capacity, dtype=torch.uint8, device=device)
        self._turn = 0
        self._layout: Layout = {}
        self._end = 0
        self._host_views: dict[tuple, dict[str, np.ndarray]] = {}

    def stage(self, tokens: int, seqs: int, samples: int, deltas: int, work: int) -> dict[str, np.ndarray]:
        layout, end = _layout(tokens, seqs, samples, deltas, work)
        if end > self.device_buf.numel():
            raise ValueError(
                f"a step of {tokens} tokens over {seqs} rows is over the worker's buffers: the "
                f"scheduler must keep within max_num_batched_tokens and max_num_seqs"
            )
        self._turn ^= 1
        self._layout, self._end = layout, end
        key = (self._turn, tokens, seqs, samples, deltas, work)
        views = self._host_views.get(key)
        if views is None:  # a step shape seen before (every decode step of a batch size) costs nothing here
            if len(self._host_views) > 4096:
                self._host_views.clear()
            buf = self._host_np[self._turn]
            views = self._host_views[key] = {name: buf[off : off + n].view(dt) for name, (off, n, dt) in layout.items()}
        return views

    def write(
        self,
        step: HostStep,
        host_ids: np.ndarray,
        deltas: tuple[np.ndarray, np.ndarray],
        dummy_row: int,
        padded_to: int | None = None,
    ) -> None:
        """Stage and upload a step, padded to the graph size that runs it; padded lanes store and attend nothing."""
        b, t = len(step.rows), len(step.positions)
        if step.is_decode:
            work, lanes = None, padded_to or b
            v = self.stage(lanes, lanes, lanes, len(deltas[0]), 0)
            _put(v["sample_pos"], step.sample_pos, 0)
        else:
            sample_lanes, sample_idx, sample_pos = step.sample_points()
            work = self.attention.work_items(step.num_tokens)
            tokens, seqs, items = self.prefill_shape(padded_to) if padded_to else (t, b, work.shape[1])
            v = self.stage(tokens, seqs, len(sample_lanes), len(deltas[0]), items)
            v["sample_pos"][:] = sample_pos
        _put(v["rows"], step.rows, dummy_row)
        _put(v["positions"], step.positions, 0)
        _put(v["slot_mapping"], step.slot_mapping, -1)
        _put(v["context_lens"], step.context_lens, 0)
        if work is not None:
            _put(v["cu_seqlens_q"], step.cu_seqlens_q, t)  # padded sequences have no queries
            _put(v["input_ids"][step.num_device_tokens :], host_ids, 0)
            for dst, items in zip(v["work"].reshape(2, -1), work):
                _put(dst, items, -1)
            v["sample_idx"][:] = sample_idx
            v["sample_rows"][:] = step.rows[sample_lanes]
        if len(deltas[0]):
            v["delta_idx"][:] = deltas[0]
            v["delta_val"][:] = deltas[1]
        self.device_buf[: self._end].copy_(self._host[self._turn][: self._end], non_blocking=True)

    def view(self, name: str) -> torch.Tensor:
        return self._device_view(*self._layout[name])

    def decode_views(self, size: int) -> dict[str, torch.Tensor]:
        """The static device views a decode graph of batch `size` reads."""
        layout, _ = _layout(size, size, size, 0, 0)
        return {name: self._device_view(*layout[name]) for name in _DECODE_READS}

    def prefill_shape(self, tokens: int) -> tuple[int, int, int]:
        """Tokens, sequences and work items of the static layout of a prefill graph of `tokens` tokens."""
        seqs = min(tokens, self.max_seqs)  # every sequence of a step brings at least one token
        return tokens, seqs, self.attention.max_work_items(tokens, seqs)

    def prefill_views(self, tokens: int | None = None) -> dict[str, torch.Tensor]:
        """The views a prefill graph of `tokens` tokens reads, or (None) those of the step staged last."""
        if tokens is None:
            layout = self._layout
        else:
            tokens, seqs, items = self.prefill_shape(tokens)
            layout = _layout(tokens, seqs, 0, 0, items)[0]
        views = {name: self._device_view(*layout[name]) for name in _PREFILL_READS}
        views["work"] = views["work"].view(2, -1)
        return views

    def _device_view(self, off: int, nbytes: int, dt: type) -> torch.Tensor:
        return self.device_buf[off : off + nbytes].view(_TORCH[dt])


def _put(dst: np.ndarray, values: np.ndarray, pad_value: int) -> None:
    dst[: len(values)] = values
    if len(values) < len(dst):
        dst[len(values) :] = pad_value
