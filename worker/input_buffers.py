"""The worker's row mirror and its static input buffers: a StepPlan becomes tensors with one copy.

Every array of a step is written with numpy into one pinned host staging buffer and reaches the device in
a single host->device copy, where typed views of a static device buffer read it. The layout puts the
arrays a captured graph reads first, so their offsets depend on the graph's size alone: a decode graph
captured for batch size b, or a prefill graph for a bucket of b tokens, reads the same addresses on every
replay. A step run by a graph is staged padded to the graph's size.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from kernels.prefill_attention import max_prefill_work, prefill_work
from protocol.messages import NewRow, StepPlan

# (name, dtype, size key). A decode graph of size b reads the first four fields at T == B == b; a prefill
# graph reads the first seven.
_FIELDS = (
    ("rows", np.int64, "B"),  # mirror row of each scheduled sequence (padded lanes: the dummy row)
    ("positions", np.int64, "T"),
    ("slot_mapping", np.int64, "T"),
    ("context_lens", np.int32, "B"),
    ("cu_seqlens_q", np.int32, "B1"),
    ("input_ids", np.int64, "T"),  # prompt tokens; decode tokens are filled on the device
    ("work", np.int32, "W2"),  # prefill attention's [2, W] work items (kernels/prefill_attention.py); -1: none
    ("sample_idx", np.int64, "S"),  # token index of each sampled row's last token
    ("sample_rows", np.int64, "S"),
    ("sample_pos", np.int64, "S"),  # index in its sequence of the token being sampled (seeds hash it)
    ("delta_idx", np.int64, "D"),  # flat [row * M + col] entries of the block table that change
    ("delta_val", np.int32, "D"),
)
_TORCH = {np.int64: torch.int64, np.int32: torch.int32}
_DECODE_READS = ("rows", "positions", "slot_mapping", "context_lens", "sample_pos")
_PREFILL_READS = ("rows", "positions", "slot_mapping", "context_lens", "cu_seqlens_q", "input_ids", "work")


# Triton specialises a pointer argument on whether it is 16-byte aligned: fields at 8-byte offsets that move
# with the step's sizes made eager (prompt) steps compile new kernel variants in the middle of serving.
FIELD_ALIGN = 16


@functools.lru_cache(maxsize=4096)
def _layout(tokens: int, seqs: int, samples: int, deltas: int,
            work: int) -> tuple[dict[str, tuple[int, int, type]], int]:
    """Byte offset, byte length and dtype of every field, and the end; each field starts FIELD_ALIGN-aligned."""
    sizes = {"T": tokens, "B": seqs, "B1": seqs + 1, "S": samples, "D": deltas, "W2": 2 * work}
    out, offset = {}, 0
    for name, dtype, key in _FIELDS:
        nbytes = sizes[key] * np.dtype(dtype).itemsize
        out[name] = (offset, nbytes, dtype)
        offset += -(-nbytes // FIELD_ALIGN) * FIELD_ALIGN
    return out, offset


class StepBuffers:
    """Two pinned host staging buffers (alternating, so one may be in flight) and one device buffer.
    `group` is the model's query heads per KV head, which sets the prefill attention's work items."""

    def __init__(self, max_tokens: int, max_seqs: int, max_deltas: int, group: int, device: torch.device) -> None:
        self.max_seqs, self.group = max_seqs, group
        work = max_prefill_work(max_tokens, max_seqs, group)
        _, capacity = _layout(max_tokens, max_seqs, max_seqs, max_deltas, work)
        pin = device.type == "cuda"
        self._host = [torch.zeros(capacity, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self._host_np = [h.numpy() for h in self._host]
        self.device_buf = torch.zeros(capacity, dtype=torch.uint8, device=device)
        self._turn = 0
        self._layout: dict = {}
        self._end = 0
        self._host_views: dict[tuple, dict[str, np.ndarray]] = {}

    def stage(self, tokens: int, seqs: int, samples: int, deltas: int, work: int) -> dict[str, np.ndarray]:
        """Numpy views of the next host buffer under this step's layout, to fill."""
        layout, end = _layout(tokens, seqs, samples, deltas, work)
        if end > self.device_buf.numel():
            raise ValueError(f"a step of {tokens} tokens over {seqs} rows is over the worker's buffers: the "
                             f"scheduler must keep within max_num_batched_tokens and max_num_seqs")
        self._turn ^= 1
        self._layout, self._end = layout, end
        key = (self._turn, tokens, seqs, samples, deltas, work)
        views = self._host_views.get(key)
        if views is None:  # a step shape seen before (every decode step of a batch size) costs nothing here
            if len(self._host_views) > 4096:
                self._host_views.clear()
            buf = self._host_np[self._turn]
            views = self._host_views[key] = {name: buf[off:off + n].view(dt) for name, (off, n, dt) in layout.items()}
        return views

    def upload(self) -> None:
        """The one host->device copy of the step (asynchronous from pinned memory)."""
        self.device_buf[:self._end].copy_(self._host[self._turn][:self._end], non_blocking=True)

    def write(self, step: HostStep, host_ids: np.ndarray, deltas: tuple[np.ndarray, np.ndarray], dummy_row: int,
              padded_to: int | None = None) -> None:
        """Stage and upload a step. padded_to: the size of the graph that runs it, whose static layout the step
        fills (a decode step's lanes, a prompt step's tokens); padded lanes store and attend nothing.

        A decode step leaves input_ids, work, sample_idx and sample_rows unwritten: its reads are _DECODE_READS.
        """
        b, t = len(step.rows), len(step.positions)
        if step.is_decode:
            sampled, work, lanes = slice(None), None, padded_to or b
            v = self.stage(lanes, lanes, lanes, len(deltas[0]), 0)
        else:
            sampled, work = np.flatnonzero(step.samples), prefill_work(step.num_tokens, self.group)
            tokens, seqs, items = self.prefill_shape(padded_to) if padded_to else (t, b, work.shape[1])
            v = self.stage(tokens, seqs, len(sampled), len(deltas[0]), items)
        _put(v["rows"], step.rows, dummy_row)
        _put(v["positions"], step.positions, 0)
        _put(v["slot_mapping"], step.slot_mapping, -1)
        _put(v["context_lens"], step.context_lens, 0)
        _put(v["sample_pos"], step.sample_pos[sampled], 0)
        if work is not None:
            _put(v["cu_seqlens_q"], step.cu_seqlens_q, t)  # padded sequences have no queries
            _put(v["input_ids"][step.num_device_tokens:], host_ids, 0)
            for dst, items in zip(v["work"].reshape(2, -1), work):
                _put(dst, items, -1)
            v["sample_idx"][:] = step.cu_seqlens_q[1:][sampled] - 1
            v["sample_rows"][:] = step.rows[sampled]
        if len(deltas[0]):
            v["delta_idx"][:] = deltas[0]
            v["delta_val"][:] = deltas[1]
        self.upload()

    def view(self, name: str) -> torch.Tensor:
        """Device view of one field under the staged layout."""
        return self._device_view(*self._layout[name])

    def decode_views(self, size: int) -> dict[str, torch.Tensor]:
        """The static device views a decode graph of batch `size` reads (the same for every step of it)."""
        layout, _ = _layout(size, size, size, 0, 0)
        return {name: self._device_view(*layout[name]) for name in _DECODE_READS}

    def prefill_shape(self, tokens: int) -> tuple[int, int, int]:
        """Tokens, sequences and work items of the static layout of a prefill graph of `tokens` tokens."""
        seqs = min(tokens, self.max_seqs)  # every sequence of a step brings at least one token
        return tokens, seqs, max_prefill_work(tokens, seqs, self.group)

    def prefill_views(self, tokens: int | None = None) -> dict[str, torch.Tensor]:
        """The device views a prompt step reads: those of a prefill graph of `tokens` tokens (static), or with
        tokens None those of the step staged last."""
        if tokens is None:
            layout = self._layout
        else:
            tokens, seqs, items = self.prefill_shape(tokens)
            layout = _layout(tokens, seqs, 0, 0, items)[0]
        views = {name: self._device_view(*layout[name]) for name in _PREFILL_READS}
        views["work"] = views["work"].view(2, -1)
        return views

    def _device_view(self, off: int, nbytes: int, dt: type) -> torch.Tensor:
        return self.device_buf[off:off + nbytes].view(_TORCH[dt])


def _put(dst: np.ndarray, values: np.ndarray, pad_value: int) -> None:
    dst[:len(values)] = values
    if len(values) < len(dst):
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

    def __init__(self, max_rows: int, max_blocks_per_seq: int, block_size: int, num_kv_blocks: int) -> None:
        self.max_rows, self.block_size, self.max_blocks = max_rows, block_size, max_blocks_per_seq
        self.num_kv_blocks = num_kv_blocks
        self.tokens: list[np.ndarray | None] = [None] * max_rows
        self.num_host = np.zeros(max_rows, np.int64)
        self.computed = np.zeros(max_rows, np.int64)
        self.total = np.zeros(max_rows, np.int64)  # known tokens, sampled ones included
        self.num_blocks = np.zeros(max_rows, np.int64)
        self.block_table = np.zeros((max_rows, max_blocks_per_seq), np.int64)
        self.active = np.zeros(max_rows, bool)
        self._mark = np.zeros(max_rows, np.int64)  # scratch of the duplicate-row check
        self._arange = np.arange(max_rows + 1, dtype=np.int64)
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
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_kv_blocks):
            # The kernels do not check: a stray id would read or write another block's (or layer's) KV.
            bad = int(ids[(ids < 0) | (ids >= self.num_kv_blocks)][0])
            raise ValueError(f"block id {bad} appended to row {row} is outside the KV cache's {self.num_kv_blocks} "
                             f"blocks: the scheduler must hand out ids in [0, {self.num_kv_blocks})")
        self.block_table[row, start:start + len(ids)] = ids
        self.num_blocks[row] = start + len(ids)
        cols = np.arange(start, start + len(ids), dtype=np.int64)
        self._deltas.append((row * self.max_blocks + cols, ids))

    def free(self, rows: np.ndarray) -> None:
        for row in np.asarray(rows, np.int64).tolist():
            self._check_row(row, "free row")
            self.active[row] = False
            self.tokens[row] = None
            self.computed[row] = self.total[row] = self.num_host[row] = 0

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
        """Positions, slots and lengths of the plan's tokens, checked against the mirror (numpy, no loops).

        Checks use np.count_nonzero: on arrays this small it costs a third of .any() or .min().
        """
        rows = plan.rows.astype(np.int64)
        n = plan.num_tokens.astype(np.int64)
        start, total = self._gather_checked(rows, n)
        ctx = start + n
        b = len(rows)
        nd = np.count_nonzero(start >= self.num_host[rows])
        if not np.count_nonzero(n != 1):  # single tokens only (every decode step): no repeat, no cumsum
            tok_rows, positions, cu = rows, start, self._arange[:b + 1]
        else:
            cu = np.zeros(b + 1, np.int64)
            np.cumsum(n, out=cu[1:])
            tok_rows = np.repeat(rows, n)
            positions = np.arange(cu[-1]) - np.repeat(cu[:-1] - start, n)
        if nd < b and (np.count_nonzero(start[nd:] >= self.num_host[rows[nd:]]) or np.count_nonzero(n[:nd] != 1)):
            raise ValueError("StepPlan must list decode rows (one token, past the row's known tokens) first")
        short = ctx > self.num_blocks[rows] * self.block_size
        if np.count_nonzero(short):
            row = int(rows[np.argmax(short)])
            raise ValueError(f"row {row} has {self.num_blocks[row]} blocks, too few for its tokens after this "
                             f"step: append its blocks first")
        slots = self.block_table[tok_rows, positions // self.block_size] * self.block_size \
            + positions % self.block_size
        return HostStep(rows, n, positions, slots, ctx, cu, ctx == total, total, int(nd))

    def _gather_checked(self, rows: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """computed and total of the plan's rows; every row active, listed once, asked for known tokens."""
        b = len(rows)
        # Viewed unsigned, a negative row is huge: one comparison checks both ends.
        if b == 0 or n.shape != rows.shape or np.count_nonzero(rows.view(np.uint64) >= self.max_rows):
            raise ValueError(f"StepPlan rows {rows.tolist()} with num_tokens {n.tolist()}: give one count per "
                             f"row, rows in [0, {self.max_rows})")
        start, total = self.computed[rows], self.total[rows]
        self._mark[rows] = self._arange[:b]  # a row listed twice keeps only its last index here
        # An inactive row has total 0, so asking it for any token fails the known-tokens check too.
        if np.count_nonzero((n < 1) | (start + n > total) | (self._mark[rows] != self._arange[:b])):
            raise ValueError(f"StepPlan rows {rows.tolist()} / num_tokens {n.tolist()} do not fit the mirror "
                             f"(computed {start.tolist()}, known {total.tolist()}): rows must be active, "
                             f"unique, and ask for at least one and at most their known tokens")
        return start, total

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
