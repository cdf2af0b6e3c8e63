"""Prompt logprobs: in a prompt step, the logprob of each prompt token given the tokens before it, for the rows
that ask. The logits of a chunk's positions are made only for those rows and a slice at a time, so a step of rows
that do not ask computes nothing more, and a long prompt never holds [T, vocab] logits at once."""

from __future__ import annotations

import numpy as np
import torch

from worker.row_mirror import HostStep, RowMirror
from worker.sampler import upload

SLICE = 256  # positions per lm_head call: [SLICE, vocab] float32 logits, ~150 MiB at a 152K vocabulary


class PromptLogprobs:
    """Each row's number of top prompt logprobs (-1: none) and prompt length, as its NewRow gave them."""

    def __init__(self, max_rows: int) -> None:
        self.k = np.full(max_rows, -1, np.int64)
        self.num_prompt = np.zeros(max_rows, np.int64)
        self.count = 0  # rows that ask: zero makes every step skip this

    def add_row(self, row: int, k: int, num_prompt: int) -> None:
        self.remove_row(row)
        self.k[row], self.num_prompt[row] = k, num_prompt
        self.count += int(k >= 0)

    def remove_row(self, row: int) -> None:
        self.count -= int(self.k[row] >= 0)
        self.k[row] = -1

    def compute(self, model: torch.nn.Module, hidden: torch.Tensor, step: HostStep, mirror: RowMirror) -> dict | None:
        """The step's prompt logprobs on the device (host copies are the caller's): per asking lane, its first
        target position and count; flat over targets, the target's logprob and rank, and the top k."""
        if not self.count:
            return None
        rows = step.rows
        start = step.context_lens - step.num_tokens
        # Position p predicts token p + 1, so a prompt of n tokens has targets 1 .. n - 1.
        counts = np.minimum(step.context_lens, self.num_prompt[rows] - 1) - start
        lanes = np.flatnonzero((self.k[rows] >= 0) & (counts > 0) & (np.arange(len(rows)) >= step.num_device_tokens))
        if not len(lanes):
            return None
        counts = counts[lanes]
        token_idx = np.concatenate([np.arange(n) + step.cu_seqlens_q[lane] for lane, n in zip(lanes, counts)])
        targets = np.concatenate(
            [mirror.tokens[rows[lane]][start[lane] + 1 : start[lane] + 1 + n] for lane, n in zip(lanes, counts)]
        )
        k = int(self.k[rows[lanes]].max())
        parts = [
            _slice_logprobs(model, hidden, token_idx[i : i + SLICE], targets[i : i + SLICE], k)
            for i in range(0, len(token_idx), SLICE)
        ]
        tensors = [torch.cat(column) for column in zip(*parts)]
        return {"lanes": lanes, "start": start[lanes] + 1, "count": counts, "k": k, "tensors": tensors}


def _slice_logprobs(
    model: torch.nn.Module, hidden: torch.Tensor, token_idx: np.ndarray, targets: np.ndarray, k: int
) -> tuple[torch.Tensor, ...]:
    """(target logprobs, their ranks, top-k ids, top-k logprobs) of one slice: of the raw logits, as sampled ones."""
    logits = model.compute_logits(hidden[upload(token_idx, hidden.device)])
    logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    target = logprobs.gather(1, upload(targets.astype(np.int64), hidden.device)[:, None])
    rank = (logprobs > target).sum(dim=-1, dtype=torch.int32) + 1
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return target.squeeze(1), rank, top_ids.to(torch.int32), top_logprobs
