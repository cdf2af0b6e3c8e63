"""What a caller gets back: RequestOutput holding one CompletionOutput per sample (n)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort" (or "error" with RequestOutput.error)
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: logprob} of sampled + top-k
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None  # set when the engine failed the request
    num_cached_tokens: int = 0
