"""Every message that crosses a process boundary. PROTOCOL.md documents their wire form.

Arrays (token ids, rows, block ids, timings) are numpy arrays in memory and raw little-endian bytes on
the wire; the `WIRE` map of each class names the type of every field so the codec can check it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

READY_TIMEOUT_S = 900.0  # how long a Ready may take: loading a large checkpoint and capturing graphs take minutes
OVERLOADED = "engine overloaded"  # how TokenBatch.errors begins for a request refused for a full queue
I32 = "i32"  # numpy int32 array <-> raw bytes
F32 = "f32"  # numpy float32 array <-> raw bytes


def i32(values: object) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


# ---- frontend -> scheduler ---------------------------------------------------------------------------

@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: np.ndarray
    params: dict  # SamplingParams.to_dict(); the scheduler validates it again
    WIRE: ClassVar[dict] = {"request_id": str, "prompt_token_ids": I32, "params": dict}


@dataclass(slots=True)
class Abort:
    request_ids: list[str]
    WIRE: ClassVar[dict] = {"request_ids": list}


@dataclass(slots=True)
class Shutdown:
    WIRE: ClassVar[dict] = {}


@dataclass(slots=True)
class GetStats:
    WIRE: ClassVar[dict] = {}


# ---- scheduler -> frontend ---------------------------------------------------------------------------

@dataclass(slots=True)
class TokenBatch:
    """One step's new tokens: token_ids[i] is the token appended to request_ids[i] (-1: none this step).

    finished maps a request id to its finish reason ("stop", "length", "abort" or "error");
    errors carries the message of those that finished with "error". logprobs, when any request asked
    for them, is a list aligned with request_ids of None or [logprob, top_ids, top_logprobs].
    """

    step: int
    request_ids: list[str]
    token_ids: np.ndarray
    finished: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    logprobs: list | None = None
    stats: dict = field(default_factory=dict)
    WIRE: ClassVar[dict] = {"step": int, "request_ids": list, "token_ids": I32, "finished": dict,
                            "errors": dict, "logprobs": (list, type(None)), "stats": dict}


@dataclass(slots=True)
class Ready:
    role: str
    rank: int = 0
    info: dict = field(default_factory=dict)
    WIRE: ClassVar[dict] = {"role": str, "rank": int, "info": dict}


@dataclass(slots=True)
class EngineDead:
    reason: str
    WIRE: ClassVar[dict] = {"reason": str}


# ---- scheduler -> every worker rank ------------------------------------------------------------------

@dataclass(slots=True)
class NewRow:
    """A request entering the worker's mirror at `row`: its known tokens, once.

    token_ids are the prompt plus any tokens generated before a preemption; num_prompt_tokens splits
    them (penalties count only generated tokens as output); num_computed tokens are already in the KV
    cache (prefix-cache hits), so prefill starts there.
    """

    row: int
    token_ids: np.ndarray
    num_prompt_tokens: int
    num_computed: int
    block_table: np.ndarray
    params: dict
    WIRE: ClassVar[dict] = {"row": int, "token_ids": I32, "num_prompt_tokens": int, "num_computed": int,
                            "block_table": I32, "params": dict}


@dataclass(slots=True)
class StepPlan:
    """One step. rows[i] gets num_tokens[i] new tokens; decode rows (1 token, past their prompt) first.

    free_rows are dropped first (a new row may reuse one), then new_rows are added to the mirror and
    block_appends (row, new block ids) extend block tables; none of free_rows is scheduled in this plan.
    `step` increases by one per plan; every rank checks it.
    """

    step: int
    rows: np.ndarray
    num_tokens: np.ndarray
    new_rows: list = field(default_factory=list)
    block_appends: list = field(default_factory=list)
    free_rows: np.ndarray = field(default_factory=lambda: i32([]))
    trace: bool = False
    WIRE: ClassVar[dict] = {"step": int, "rows": I32, "num_tokens": I32, "new_rows": list,
                            "block_appends": list, "free_rows": I32, "trace": bool}


# ---- worker rank 0 -> scheduler ----------------------------------------------------------------------

@dataclass(slots=True)
class StepResult:
    """token_ids[i] was sampled for plan.rows[i]. logprobs: None or {"sampled": F32, "top_ids": I32,
    "top_logprobs": F32, "k": int} with top arrays flattened row-major (len(rows) * k)."""

    step: int
    token_ids: np.ndarray
    logprobs: dict | None = None
    timings: dict = field(default_factory=dict)
    WIRE: ClassVar[dict] = {"step": int, "token_ids": I32, "logprobs": (dict, type(None)), "timings": dict}


@dataclass(slots=True)
class WorkerError:
    """A worker that cannot go on says why before it exits."""

    rank: int
    reason: str
    WIRE: ClassVar[dict] = {"rank": int, "reason": str}


MESSAGE_TYPES: dict[str, type] = {cls.__name__: cls for cls in (
    AddRequest, Abort, Shutdown, GetStats, TokenBatch, Ready, EngineDead, NewRow, StepPlan, StepResult,
    WorkerError,
)}
