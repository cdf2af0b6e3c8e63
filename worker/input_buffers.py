"""The worker's row mirror and its static input buffers: a StepPlan becomes tensors with one copy.

Every array of a step is written with numpy into one pinned host staging buffer and reaches the device in
a single host->device copy, where typed views of a static device buffer read it. The layout puts the
arrays a captured decode graph reads first, so their offsets depend on the batch size alone: a graph
captured for size b reads the same addresses on every replay.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protocol.messages import NewRow, StepPlan

# (name, dtype, size key). A decode graph of size b reads the first four fields at T == B == b.
_FIELDS = (
    ("rows", np.int64, "B"),  # mirror row of each scheduled sequence (padded lanes: the dummy row)
    ("positions", np.int64, "T"),
    ("slot_mapping", np.int64, "T"),
    ("context_lens", np.int32, "B"),
    ("cu_seqlens_q", np.int32, "B1"),
    ("input_ids", np.int64, "T"),  # prompt tokens; decode tokens are filled on the device
    ("sample_idx", np.int64, "S"),  # token index of each sampled row's last token
    ("sample_rows", np.int64, "S"),
    ("sample_pos", np.int64, "S"),  # index in its sequence of the token being sampled (seeds hash it)
    ("delta_idx", np.int64, "D"),  # flat [row * M + col] entries of the block table that change
    ("delta_val", np.int32, "D"),
)
_TORCH = {np.int64: torch.int64, np.int32: torch.int32}


def _layout(sizes: dict[str, int]) -> tuple[dict[str, tuple[int, int, type]], int]:
    """Byte offset, element count and dtype of every field; each field starts 8-byte aligned."""
    out, offset = {}, 0
    for name, dtype, key in _FIELDS:
        count = sizes[key]
        out[name] = (offset, count, dtype)
        offset += -(-count * np.dtype(dtype).itemsize // 8) * 8
    return out, offset


def _sizes(tokens: int, seqs: int, samples: int, deltas: int) -> dict[str, int]:
    return {"T": tokens, "B": seqs, "B1": seqs + 1, "S": samples, "D": deltas}


class StepBuffers:
    """Two pinned host staging buffers (alternating, so one may be in flight) and one device buffer."""

    def __init__(self, max_tokens: int, max_seqs: int, max_deltas: int, device: torch.device) -> None:
        _, capacity = _layout(_sizes(max_tokens, max_seqs, max_seqs, max_deltas))
        pin = device.type == "cuda"
        self._host = [torch.zeros(capacity, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self._host_np = [h.numpy() for h in self._host]
        self.device_buf = torch.zeros(capacity, dtype=torch.uint8, device=device)
        self._turn = 0
        self._layout: dict = {}
        self._end = 0

    def stage(self, tokens: int, seqs: int, samples: int, deltas: int) -> dict[str, np.ndarray]:
        """Numpy views of the next host buffer under this step's layout, to fill."""
        layout, end = _layout(_sizes(tokens, seqs, samples, deltas))
        if end > self.device_buf.numel():
            raise ValueError(f"a step of {tokens} tokens over {seqs} rows is over the worker's buffers: the "
                             f"scheduler must keep within max_num_batched_tokens and max_num_seqs")
        self._turn ^= 1
        self._layout, self._end = layout, end
        buf = self._host_np[self._turn]
        return {name: buf[off:off + count * np.dtype(dt).itemsize].view(dt)
                for name, (off, count, dt) in self._layout.items()}

    def upload(self) -> None:
        """The one host->device copy of the step (asynchronous from pinned memory)."""
        self.device_buf[:self._end].copy_(self._host[self._turn][:self._end], non_blocking=True)

    def write(self, step: HostStep, size: int, host_ids: np.ndarray, deltas: tuple[np.ndarray, np.ndarray],
              dummy_row: int) -> None:
        """Stage and upload a step; a decode step is padded to `size` lanes that write nothing."""
        b, t, pad = len(step.rows), len(step.positions), size - len(step.rows)
        sampled = np.flatnonzero(step.samples)
        v = self.stage(t + pad, size, len(sampled) + pad, len(deltas[0]))
        _put(v["rows"], step.rows, dummy_row)
        _put(v["positions"], step.positions, 0)
        _put(v["slot_mapping"], step.slot_mapping, -1)
        _put(v["context_lens"], step.context_lens, 0)
        _put(v["cu_seqlens_q"], step.cu_seqlens_q, 0)
        v["cu_seqlens_q"][b + 1:] = np.arange(t + 1, t + pad + 1)
        v["input_ids"][step.num_device_tokens:t] = host_ids
        _put(v["sample_idx"], step.cu_seqlens_q[1:][sampled] - 1, 0)
        _put(v["sample_rows"], step.rows[sampled], dummy_row)
        _put(v["sample_pos"], step.sample_pos[sampled], 0)
        v["delta_idx"][:] = deltas[0]
        v["delta_val"][:] = deltas[1]
        self.upload()

    def view(self, name: str) -> torch.Tensor:
        """Device view of one field under the staged layout."""
        off, count, dt = self._layout[name]
        return self._device_view(off, count, dt)

    def decode_views(self, size: int) -> dict[str, torch.Tensor]:
        """The static device views a decode graph of batch `size` reads (the same for every step of it)."""
        layout, _ = _layout(_sizes(size, size, size, 0))
        return {name: self._device_view(*layout[name]) for name in ("rows", "positions", "slot_mapping",
                                                                   "context_lens", "sample_pos")}

    def _device_view(self, off: int, count: int, dt: type) -> torch.Tensor:
        return self.device_buf[off:off + count * np.dtype(dt).itemsize].view(_TORCH[dt])


def _put(dst: np.ndarray, values: np.ndarray, pad_value: int) -> None:
    dst[:len(values)] = values
    dst[len(values):] = pad_value


@dataclass(slots=True)
class HostStep:
    """What the host worked out for one step, before padding: numpy arrays over B rows and T tokens."""

    rows: np.ndarray  # [B] int64
    num_tokens: np.ndarray  # [B] int64
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    context_lens: np.ndarray  # [B]
    cu_seqlens_q: np.ndarray  # [B + 1]
    samples: np.ndarray  # [B] bool: the row's sampled token is real (its known tokens are all computed)
    sample_pos: np.ndarray  # [B]: index of the sampled token in its sequence
    num_device_tokens: int  # the first rows take their input token from the device (last sampled)

    @property
    def is_decode(self) -> bool:
        return self.num_device_tokens == len(self.rows) == len(self.positions)


class RowMirror:
    """Per row: known tokens, computed count and block table, kept in step with the scheduler by deltas.

    Invariant: computed[row] <= total[row]; tokens past the host copy (len(tokens[row])) live only on the
    device as the row's last sampled token, so at most one of them is ever waiting to be computed.
    """

    def __init__(self, max_rows: int, max_blocks_per_seq: int, block_size: int) -> None:
        self.max_rows, self.block_size, self.max_blocks = max_rows, block_size, max_blocks_per_seq
        self.tokens: list[np.ndarray | None] = [None] * max_rows
        self.num_host = np.zeros(max_rows, np.int64)
        self.computed = np.zeros(max_rows, np.int64)
        self.total = np.zeros(max_rows, np.int64)  # known tokens, sampled ones included
        self.num_blocks = np.zeros(max_rows, np.int64)
        self.block_table = np.zeros((max_rows, max_blocks_per_seq), np.int32)
        self.active = np.zeros(max_rows, bool)
        self._deltas: list[tuple[np.ndarray, np.ndarray]] = []  # for the device copy of the block table

    def add(self, new: NewRow) -> None:
        row, tokens = new.row, np.asarray(new.token_ids, np.int32)
        self._check_row(row, "NewRow.row")
        if not 0 <= new.num_computed < len(tokens):
            raise ValueError(f"NewRow for row {row}: num_computed={new.num_computed} must be in "
                             f"[0, {len(tokens)}) so that at least one token is computed")
        self.tokens[row] = tokens
        self.num_host[row] = self.total[row] = len(tokens)
        self.computed[row] = new.num_computed
        self.num_blocks[row] = 0
        self.active[row] = True
        self.append_blocks(row, new.block_table)

    def append_blocks(self, row: int, block_ids) -> None:
        ids = np.asarray(block_ids, np.int32) if not isinstance(block_ids, bytes) \
            else np.frombuffer(block_ids, "<i4")
        self._check_row(row, "block append row")
        if not self.active[row]:
            raise ValueError(f"blocks appended to row {row}, which holds no request: add it with a NewRow first")
        start = int(self.num_blocks[row])
        if start + len(ids) > self.max_blocks:
            raise ValueError(f"row {row} would hold {start + len(ids)} blocks, over max_model_len's "
                             f"{self.max_blocks}: the scheduler must not grow a row past max_model_len")
        self.block_table[row, start:start + len(ids)] = ids
        self.num_blocks[row] = start + len(ids)
        cols = np.arange(start, start + len(ids), dtype=np.int64)
        self._deltas.append((row * self.max_blocks + cols, ids))

    def free(self, rows: np.ndarray) -> None:
        for row in np.asarray(rows, np.int64).tolist():
            self._check_row(row, "free row")
            self.active[row] = False
            self.tokens[row] = None

    def take_deltas(self) -> tuple[np.ndarray, np.ndarray]:
        """Block-table entries changed since the last call: flat indices into [max_rows, M] and values."""
        if not self._deltas:
            return np.zeros(0, np.int64), np.zeros(0, np.int32)
        idx, val = (np.concatenate(parts) for parts in zip(*self._deltas))
        self._deltas.clear()
        return idx, val

    def _check_row(self, row: int, what: str) -> None:
        if not 0 <= row < self.max_rows:
            raise ValueError(f"{what}={row} is outside [0, {self.max_rows}): rows must be < max_num_seqs")

    # ---- one step -----------------------------------------------------------------------------------

    def plan(self, plan: StepPlan) -> HostStep:
        """Positions, slots and lengths of the plan's tokens, checked against the mirror."""
        rows = np.asarray(plan.rows, np.int64)
        n = np.asarray(plan.num_tokens, np.int64)
        self._check_plan(rows, n)
        start = self.computed[rows]
        cu = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(n, out=cu[1:])
        if cu[-1] == len(rows):  # all single tokens: the common decode step, without np.repeat
            tok_rows, positions = rows, start
        else:
            tok_rows = np.repeat(rows, n)
            positions = np.arange(cu[-1]) - np.repeat(cu[:-1] - start, n)
        block_idx = positions // self.block_size
        if (block_idx >= self.num_blocks[tok_rows]).any():
            bad = int(np.flatnonzero(block_idx >= self.num_blocks[tok_rows])[0])
            raise ValueError(f"row {tok_rows[bad]} has no block for position {positions[bad]} "
                             f"({self.num_blocks[tok_rows[bad]]} blocks): append its blocks first")
        slots = self.block_table[tok_rows, block_idx].astype(np.int64) * self.block_size \
            + positions % self.block_size
        ctx = start + n
        on_device = start >= self.num_host[rows]
        return HostStep(rows, n, positions, slots, ctx, cu, ctx == self.total[rows], self.total[rows],
                        int(on_device.sum()))

    def _check_plan(self, rows: np.ndarray, n: np.ndarray) -> None:
        if rows.shape != n.shape or len(rows) == 0:
            raise ValueError(f"StepPlan has {len(rows)} rows and {len(n)} token counts: they must match, >= 1")
        if (rows < 0).any() or (rows >= self.max_rows).any() or not self.active[rows].all():
            raise ValueError(f"StepPlan schedules rows {rows.tolist()}, not all of them active in the mirror")
        if len(np.unique(rows)) != len(rows) or (n < 1).any():
            raise ValueError(f"StepPlan rows {rows.tolist()} / num_tokens {n.tolist()}: rows must be unique, "
                             f"each with at least one token")
        over = self.computed[rows] + n > self.total[rows]
        if over.any():
            row = int(rows[over][0])
            raise ValueError(f"StepPlan asks row {row} for {int(n[over][0])} tokens from {self.computed[row]}, "
                             f"but the row knows only {self.total[row]}")
        on_device = self.computed[rows] >= self.num_host[rows]
        nd = int(on_device.sum())
        if on_device[nd:].any() or (n[:nd] != 1).any():
            raise ValueError("StepPlan must list decode rows (one token, past the row's known tokens) first")

    def host_input_ids(self, step: HostStep) -> np.ndarray:
        """Token ids of the rows after the decode prefix, which the host holds (prompt chunks)."""
        nd = step.num_device_tokens
        parts = [self.tokens[r][s:s + k] for r, s, k in
                 zip(step.rows[nd:].tolist(), (step.context_lens - step.num_tokens)[nd:].tolist(),
                     step.num_tokens[nd:].tolist())]
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    def finish(self, step: HostStep) -> None:
        """Advance the computed counts; a real sample is one more known token (it stays on the device)."""
        self.computed[step.rows] = step.context_lens
        self.total[step.rows[step.samples]] += 1
