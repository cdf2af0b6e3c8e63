"""Every message that crosses a process boundary (PROTOCOL.md has their wire form). Each class's `WIRE`, built
from its annotations, names every field's type for the codec; arrays are numpy int32, raw bytes on the wire."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass

import numpy as np

READY_TIMEOUT_S = 900.0  # loading a large checkpoint and capturing graphs take minutes
OVERLOADED = "engine overloaded"  # how TokenBatch.errors begins for a request refused for a full queue
I32 = "i32"  # a numpy int32 array, raw bytes on the wire


def i32(values: object) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: np.ndarray
    params: dict  # SamplingParams.to_dict(); the scheduler validates it again


@dataclass(slots=True)
class Abort:
    request_ids: list


@dataclass(slots=True)
class Shutdown:
    pass


@dataclass(slots=True)
class GetStats:
    pass


@dataclass(slots=True)
class TokenBatch:
    """One step's new tokens for one client: token_ids[i] goes to request_ids[i] (-1: none, only a finish)."""

    step: int
    request_ids: list
    token_ids: np.ndarray
    finished: dict = field(default_factory=dict)  # request id -> "stop", "length", "abort" or "error"
    errors: dict = field(default_factory=dict)
    logprobs: list | None = None  # aligned with request_ids: None or [logprob, top_ids, top_logprobs]
    # request id -> its prompt tokens' [logprobs, ranks, top ids, top logprobs] (from the second token), once, with
    # its first token; only for requests that ask (SamplingParams.prompt_logprobs)
    prompt_logprobs: dict | None = None
    stats: dict = field(default_factory=dict)
    request_stats: dict = field(default_factory=dict)  # request id -> queue time, cached tokens: with its first token


@dataclass(slots=True)
class Ready:
    role: str
    rank: int = 0
    info: dict = field(default_factory=dict)


@dataclass(slots=True)
class EngineDead:
    reason: str


@dataclass(slots=True)
class Error:
    """A frame or message the engine refused, where no request can carry it (no request id, or a live one's)."""

    reason: str
    request_id: str | None = None


@dataclass(slots=True)
class RowSampling:
    """What a worker samples a row with: the numbers it uses of the request's resolved SamplingParams (defaults: off)."""

    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0  # int64
    logprobs: int = -1  # how many top logprobs; -1: none
    prompt_logprobs: int = -1  # the same, of the prompt's tokens in its prompt steps
    min_tokens: int = 0
    stop_token_ids: list = field(default_factory=list)  # banned until min_tokens outputs (empty without them)
    logit_bias: dict = field(default_factory=dict)  # token id -> added to its logit
    grammar: bool = False  # the row samples under a GrammarMask


@dataclass(slots=True)
class NewRow:
    """A request entering the worker's mirror at `row`: its known tokens, once."""

    row: int
    token_ids: np.ndarray
    num_prompt_tokens: int
    num_computed: int  # tokens already in the KV cache (prefix-cache hits): prefill starts there
    block_table: np.ndarray
    sampling: RowSampling


@dataclass(slots=True)
class StepPlan:
    """One step: rows[i] gets num_tokens[i] new tokens, decode rows first; none of free_rows is scheduled."""

    step: int
    rows: np.ndarray
    num_tokens: np.ndarray
    new_rows: list = field(default_factory=list)
    block_appends: list = field(default_factory=list)  # [row, new block ids]
    free_rows: np.ndarray = field(default_factory=lambda: i32([]))
    trace: bool = False
    masked: np.ndarray = field(default_factory=lambda: i32([]))  # indices into rows: sample under a GrammarMask
    # Speculative decoding: [row, computed, tokens] resets a row's mirror to `computed` tokens in the KV cache and
    # the known `tokens` after them (its last accepted token, then drafts); `verify` indexes the rows that sample
    # after every token of their chunk, not only the last.
    rewinds: list = field(default_factory=list)
    verify: np.ndarray = field(default_factory=lambda: i32([]))


@dataclass(slots=True)
class GrammarMask:
    """Step `step`'s first `rows` rows of the shared mask file are its masked rows' (protocol/shared_masks.py)."""

    step: int
    rows: int


@dataclass(slots=True)
class StepResult:
    """token_ids[i] was sampled for plan.rows[i]; logprobs as PROTOCOL.md says."""

    step: int
    token_ids: np.ndarray
    logprobs: dict | None = None
    prompt_logprobs: dict | None = None  # of the prompt tokens this step computed, for rows that ask (PROTOCOL.md)
    verify_tokens: np.ndarray = field(default_factory=lambda: i32([]))  # each verify row's samples, in order
    timings: dict = field(default_factory=dict)


@dataclass(slots=True)
class WorkerError:
    rank: int
    reason: str


_KINDS = {  # annotation -> the codec's check
    "np.ndarray": I32,
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    "dict": dict,
    "list": list,
    "RowSampling": RowSampling,  # a nested message
    "dict | None": (dict, type(None)),
    "list | None": (list, type(None)),
    "str | None": (str, type(None)),
}
# Every dataclass above is a message type, named on the wire by its class name.
MESSAGE_TYPES: dict[str, type] = {name: cls for name, cls in dict(globals()).items() if is_dataclass(cls)}
for _cls in MESSAGE_TYPES.values():
    _cls.WIRE = {f.name: _KINDS[f.type] for f in fields(_cls)}
