"""A StepResult checked and split per scheduled row: its tokens (a verify row's several), the logprobs of sampled
tokens, and those of prompt tokens (kept on the request until its first token goes out with them)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from protocol.messages import StepResult
from scheduler.request import Status


def checked_tokens(
    result: StepResult, scheduled: list, verify_sizes: list[int], vocab_size: int
) -> tuple[np.ndarray, Iterator[np.ndarray]]:
    """Each row's token, and each verify row's verify_sizes samples in turn, all checked inside the vocabulary."""
    tokens, verify = np.asarray(result.token_ids), np.asarray(result.verify_tokens)
    if tokens.shape != (len(scheduled),):
        raise ValueError(
            f"StepResult for step {result.step} has {tokens.shape} token ids for {len(scheduled)} scheduled rows"
        )
    if verify.shape != (sum(verify_sizes),):
        raise ValueError(f"StepResult for step {result.step} has {verify.shape} verify tokens, not {verify_sizes}")
    sampled = tokens[[samples for _, _, samples, _ in scheduled]]
    for ids in (sampled, verify):
        if ((ids < 0) | (ids >= vocab_size)).any():
            raise ValueError(
                f"StepResult for step {result.step} samples token ids {ids.tolist()} outside "
                f"the vocabulary [0, {vocab_size})"
            )
    return tokens, iter(np.split(verify, np.cumsum(verify_sizes)[:-1]))


def split_logprobs(lp: dict | None, n: int):
    """None, or (row i, its k) -> [sampled logprob, top ids, top logprobs], from k columns per row (bytes or arrays)."""
    if lp is None:
        return None
    k = lp.get("k")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"StepResult.logprobs['k'] must be an int >= 0, got {k!r}")
    sampled = _array(lp.get("sampled"), "<f4")
    top_ids = _array(lp.get("top_ids"), "<i4")
    top_lps = _array(lp.get("top_logprobs"), "<f4")
    if sampled.shape != (n,) or top_ids.shape != (n * k,) or top_lps.shape != (n * k,):
        raise ValueError(
            f"StepResult.logprobs does not fit {n} rows of k={k}: {sampled.shape}, {top_ids.shape}, {top_lps.shape}"
        )
    return lambda i, want: [
        float(sampled[i]),
        top_ids[i * k : i * k + min(want, k)].tolist(),
        top_lps[i * k : i * k + min(want, k)].tolist(),
    ]


def _array(value: object, dtype: str) -> np.ndarray:
    """A StepResult array: raw bytes off the wire, or a runner's own array in process (None: empty)."""
    if isinstance(value, bytes):
        return np.frombuffer(value, dtype)  # ValueError unless whole
    return np.asarray([] if value is None else value, dtype).reshape(-1)


def take_prompt_logprobs(lp: dict | None, scheduled: list[tuple]) -> None:
    """Append each asking row's new prompt logprobs to its request, [logprobs, ranks, top ids, top logprobs] per
    target token; a recomputed chunk's targets that the request already holds are dropped."""
    if lp is None:
        return
    k = lp.get("k")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"StepResult.prompt_logprobs['k'] must be an int >= 0, got {k!r}")
    lanes, start, count = (_array(lp.get(name), "<i4") for name in ("lanes", "start", "count"))
    logprobs, ranks = _array(lp.get("logprobs"), "<f4"), _array(lp.get("ranks"), "<i4")
    top_ids, top_lps = _array(lp.get("top_ids"), "<i4"), _array(lp.get("top_logprobs"), "<f4")
    total = int(count.sum())
    if not (
        lanes.shape == start.shape == count.shape
        and (count >= 0).all()
        and ((lanes >= 0) & (lanes < len(scheduled))).all()
        and logprobs.shape == ranks.shape == (total,)
        and top_ids.shape == top_lps.shape == (total * k,)
    ):
        raise ValueError(
            f"StepResult.prompt_logprobs does not fit {len(scheduled)} rows: lanes {lanes.tolist()}, counts "
            f"{count.tolist()}, {logprobs.shape} logprobs, {top_ids.shape} top ids of k={k}"
        )
    top_ids, top_lps = top_ids.reshape(total, k), top_lps.reshape(total, k)
    for lane, first, n, at in zip(lanes.tolist(), start.tolist(), count.tolist(), (np.cumsum(count) - count).tolist()):
        req, epoch, *_ = scheduled[lane]
        if req.status is not Status.RUNNING or req.num_preemptions != epoch or not req.wants_prompt_logprobs:
            continue  # finished, aborted or preempted since this step was planned
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [[], [], [], []]
        skip = len(req.prompt_logprobs[0]) + 1 - first  # target t is at index t - 1
        if skip < 0:
            raise ValueError(f"StepResult.prompt_logprobs of {req.request_id} skips targets before position {first}")
        want, rows = req.params.prompt_logprobs, slice(at + min(skip, n), at + n)
        for held, new in zip(
            req.prompt_logprobs, (logprobs[rows], ranks[rows], top_ids[rows, :want], top_lps[rows, :want])
        ):
            held.extend(new.tolist())
