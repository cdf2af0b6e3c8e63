"""The worker's row mirror: per row, the tokens, computed count and block table the scheduler sent, kept in
step with it by the plans' deltas; a StepPlan becomes the host arrays of one step (HostStep)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocol.messages import NewRow, StepPlan


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
    verify: np.ndarray  # lanes that sample after every token of their chunk (speculative decoding's drafts)

    @property
    def is_decode(self) -> bool:
        return self.num_device_tokens == len(self.rows) == len(self.positions)

    def sample_points(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per sample, in lane order: its lane, the index in the step of the token it follows, and the index in its
        sequence of the token it draws. A row samples after its last token, a verify row after each of them."""
        lanes = np.flatnonzero(self.samples)
        last = self.cu_seqlens_q[1:][lanes] - 1
        if not len(self.verify):
            return lanes, last, self.sample_pos[lanes]
        counts = np.ones(len(self.rows), np.int64)
        counts[self.verify] = self.num_tokens[self.verify]
        counts = counts[lanes]
        within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        first = np.repeat(last - counts + 1, counts) + within
        return np.repeat(lanes, counts), first, np.repeat(self.sample_pos[lanes] - counts + 1, counts) + within


class RowMirror:
    """Invariant: computed[row] <= total[row]; tokens past the host copy live only on the device as the row's
    last sampled token, so at most one of them is ever waiting to be computed."""

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

    def enter_row(self, new: NewRow) -> None:
        """A request enters its row: its known tokens and block table replace whatever the row held."""
        row, tokens = new.row, np.asarray(new.token_ids, np.int32)
        self._check_row(row, "NewRow.row")
        if not 0 <= new.num_computed < len(tokens):
            raise ValueError(
                f"NewRow for row {row}: num_computed={new.num_computed} must be in "
                f"[0, {len(tokens)}) so that at least one token is computed"
            )
        self.tokens[row] = tokens
        self.num_host[row] = self.total[row] = len(tokens)
        self.computed[row] = new.num_computed
        self.num_blocks[row] = 0
        self.active[row] = True
        self.append_blocks(row, new.block_table)

    def append_blocks(self, row: int, block_ids) -> None:
        ids = _int32s(block_ids)
        self._check_row(row, "block append row")
        if not self.active[row]:
            raise ValueError(f"blocks appended to row {row}, which holds no request: add it with a NewRow first")
        start = int(self.num_blocks[row])
        if start + len(ids) > self.max_blocks:
            raise ValueError(
                f"row {row} would hold {start + len(ids)} blocks, over max_model_len's "
                f"{self.max_blocks}: the scheduler must not grow a row past max_model_len"
            )
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_kv_blocks):
            # The kernels do not check: a stray id would read or write another block's (or layer's) KV.
            bad = int(ids[(ids < 0) | (ids >= self.num_kv_blocks)][0])
            raise ValueError(
                f"block id {bad} appended to row {row} is outside the KV cache's {self.num_kv_blocks} "
                f"blocks: the scheduler must hand out ids in [0, {self.num_kv_blocks})"
            )
        self.block_table[row, start : start + len(ids)] = ids
        self.num_blocks[row] = start + len(ids)
        self._deltas.append((row * self.max_blocks + np.arange(start, start + len(ids), dtype=np.int64), ids))

    def rewind(self, row: int, computed: int, token_ids) -> None:
        """Speculative decoding: the row's first `computed` tokens stay in the KV cache (no more: rejected drafts
        are dropped); `token_ids` are known after them."""
        ids = _int32s(token_ids)
        self._check_row(row, "rewind row")
        if not self.active[row] or not 0 <= computed <= self.computed[row] or not len(ids):
            raise ValueError(
                f"rewind of row {row} to {computed} computed tokens (it has {self.computed[row]}) with {len(ids)} "
                "tokens: the row must be active, keep at most its computed tokens and get at least one token"
            )
        end, held = computed + len(ids), self.tokens[row]
        if len(held) < end or not held.flags.writeable:  # a NewRow's array may be the frame's read-only bytes
            grown = np.zeros(max(end, 2 * len(held)), np.int32)
            grown[: len(held)] = held
            self.tokens[row] = held = grown
        held[computed:end] = ids
        self.computed[row] = computed
        self.num_host[row] = self.total[row] = end

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

    def plan(self, plan: StepPlan) -> HostStep:
        """Positions, slots and lengths of the plan's tokens, checked against the mirror (numpy, no loops;
        np.count_nonzero is the cheapest check on arrays this small)."""
        rows = plan.rows.astype(np.int64)
        n = plan.num_tokens.astype(np.int64)
        start, total = self._gather_checked(rows, n)
        ctx = start + n
        b = len(rows)
        nd = np.count_nonzero(start >= self.num_host[rows])
        if not np.count_nonzero(n != 1):  # single tokens only (every decode step): no repeat, no cumsum
            tok_rows, positions, cu = rows, start, self._arange[: b + 1]
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
            raise ValueError(
                f"row {row} has {self.num_blocks[row]} blocks, too few for its tokens after this "
                f"step: append its blocks first"
            )
        slots = self.block_table[tok_rows, positions // self.block_size] * self.block_size + positions % self.block_size
        verify = plan.verify.astype(np.int64)
        if len(verify) and (verify.min() < nd or verify.max() >= b or (ctx[verify] != total[verify]).any()):
            raise ValueError(f"StepPlan verify lanes {verify.tolist()} must be prompt-chunk rows that sample")
        return HostStep(rows, n, positions, slots, ctx, cu, ctx == total, total, int(nd), verify)

    def _gather_checked(self, rows: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """computed and total of the plan's rows; every row active, listed once, asked for known tokens."""
        b = len(rows)
        # Viewed unsigned, a negative row is huge: one comparison checks both ends.
        if b == 0 or n.shape != rows.shape or np.count_nonzero(rows.view(np.uint64) >= self.max_rows):
            raise ValueError(
                f"StepPlan rows {rows.tolist()} with num_tokens {n.tolist()}: give one count per "
                f"row, rows in [0, {self.max_rows})"
            )
        start, total = self.computed[rows], self.total[rows]
        self._mark[rows] = self._arange[:b]  # a row listed twice keeps only its last index here
        # An inactive row has total 0, so asking it for any token fails the known-tokens check too.
        if np.count_nonzero((n < 1) | (start + n > total) | (self._mark[rows] != self._arange[:b])):
            raise ValueError(
                f"StepPlan rows {rows.tolist()} / num_tokens {n.tolist()} do not fit the mirror "
                f"(computed {start.tolist()}, known {total.tolist()}): rows must be active, "
                f"unique, and ask for at least one and at most their known tokens"
            )
        return start, total

    def host_input_ids(self, step: HostStep) -> np.ndarray:
        """Token ids of the rows after the decode prefix, which the host holds (prompt chunks)."""
        nd = step.num_device_tokens
        starts = (step.context_lens - step.num_tokens)[nd:]
        chunks = zip(step.rows[nd:].tolist(), starts.tolist(), step.num_tokens[nd:].tolist())
        parts = [self.tokens[r][s : s + k] for r, s, k in chunks]
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    def finish(self, step: HostStep) -> None:
        """Advance the computed counts; a real sample is one more known token (it stays on the device)."""
        self.computed[step.rows] = step.context_lens
        self.total[step.rows[step.samples]] += 1


def _int32s(values) -> np.ndarray:
    """A plan's id list: raw little-endian bytes off the wire, or an array in process."""
    return np.frombuffer(values, "<i4") if isinstance(values, bytes) else np.asarray(values, np.int32)
