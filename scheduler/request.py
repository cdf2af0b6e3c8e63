"""One request as the scheduler owns it: its tokens, progress, row, blocks and fate."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from protocol.sampling import SamplingParams
from scheduler.speculation import NgramDrafter


class Status(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed; holds no row, no blocks
    RUNNING = "running"  # holds a row and blocks; prefilling or decoding
    FINISHED = "finished"
    COMPILING = "compiling"  # its grammar compiles; then it waits


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    client: bytes
    token_ids: list[int]  # prompt + every token generated so far
    num_prompt_tokens: int
    params: SamplingParams
    arrival: int  # admission order; preemption picks the largest
    max_tokens: int  # params.max_tokens, or what max_model_len leaves when it is None
    stop_ids: frozenset[int]  # params.stop_token_ids (EOS added unless ignore_eos): each ends the request
    status: Status = Status.WAITING
    row: int = -1
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full known blocks
    num_cached_blocks: int = 0  # leading blocks of block_table that the prefix cache knows
    num_computed_tokens: int = 0  # tokens whose KV is (or is being) written; counted when scheduled
    num_row_tokens: int = 0  # tokens the worker's mirror got in NewRow: prefill until computed reaches it
    num_preemptions: int = 0  # also an epoch: a result planned before a preemption is stale
    queued_at: float = 0.0  # time.monotonic() when it was added
    matcher: object | None = None  # its xgrammar GrammarMatcher: StructuredOutputs makes it and feeds it every token
    first_stats: dict | None = None  # TokenBatch.request_stats: set at its first admission, sent with its first token
    prompt_logprobs: list | None = None  # [logprobs, ranks, top ids, top logprobs] of prompt tokens 1.. so far
    drafter: NgramDrafter | None = None  # while it drafts (speculative decoding)
    last_step: int = 0  # the last step planned with it: while in flight, its latest token is not known
    rewind_next: bool = False  # its last step verified drafts: the next one resets the worker's row first

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked for and some are still to come: every prompt position must be computed."""
        held = 0 if self.prompt_logprobs is None else len(self.prompt_logprobs[0])
        return self.params.prompt_logprobs is not None and held < self.num_prompt_tokens - 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_row_tokens
