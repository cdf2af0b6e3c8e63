"""Speculative decoding's host side: n-gram drafts (prompt lookup) from a request's own tokens, the greedy
acceptance of a verify step's samples, whether a request keeps drafting, and vLLM's spec-decode counters."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from protocol.config import EngineConfig, SpeculativeConfig

if TYPE_CHECKING:  # request.py holds a NgramDrafter
    from scheduler.request import Request

# A request's drafting credit: an average of the tokens its recent drafts gained; below the floor it stops drafting,
# and its steps overlap again. A verify step, not planned ahead, takes about two plain steps' time on the H200: drafts
# that gain less than one token each lose. A new request's first draft is a probe (one that gains nothing stops it:
# an open workload pays for one failed verify, not three); a lookup that waited for its token and found nothing
# cost a pipeline bubble, not a verify step, and counts as half a token.
START_CREDIT, CREDIT_DECAY, CREDIT_FLOOR, EMPTY_LOOKUP_GAIN = 1.25, 0.75, 1.0, 0.5


class NgramDrafter:
    """One request's tokens as a growing numpy array (a lookup scans them every step) and its drafting credit."""

    def __init__(self, token_ids: list[int]) -> None:
        self.tokens = np.asarray(token_ids, np.int32)
        self.size = len(token_ids)
        self.credit = START_CREDIT

    def catch_up(self, token_ids: list[int]) -> NgramDrafter:
        """Append the tokens since the last lookup: only lookups read them, so a large batch (no drafts) pays none."""
        end = len(token_ids)
        if end > len(self.tokens):
            grown = np.zeros(max(end, 2 * len(self.tokens)), np.int32)
            grown[: self.size] = self.tokens[: self.size]
            self.tokens = grown
        self.tokens[self.size : end] = token_ids[self.size :]
        self.size = end
        return self

    def settle(self, accepted: int) -> bool:
        """Count an attempt that gained `accepted` tokens; whether the request goes on drafting."""
        self.credit = CREDIT_DECAY * self.credit + (1 - CREDIT_DECAY) * accepted
        return self.credit >= CREDIT_FLOOR


class TokenHistory:
    """Recent finished requests' tokens in one array, -1 after each: where suffix drafts look beyond the request."""

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self.parts: deque[np.ndarray] = deque()
        self.tokens = np.zeros(0, np.int32)

    def add(self, token_ids: list[int]) -> None:
        self.parts.append(np.asarray([*token_ids, -1], np.int32))
        if len(self.parts) > self.max_requests:
            self.parts.popleft()
        self.tokens = np.concatenate(self.parts) if self.parts else self.tokens[:0]


def longest_match(haystack: np.ndarray, pattern: np.ndarray) -> tuple[int, int]:
    """The length and last index of the latest longest match in haystack of pattern's end; (0, -1) if none."""
    candidates = np.flatnonzero(haystack == pattern[-1])  # where a match's last token could be
    if not len(candidates):
        return 0, -1
    length = np.ones(len(candidates), np.int64)
    alive = np.ones(len(candidates), bool)
    for back in range(1, len(pattern)):
        starts = candidates - back
        alive &= starts >= 0
        alive[alive] = haystack[starts[alive]] == pattern[-1 - back]
        length += alive
        if not alive.any():
            break
    best = int(length.max())
    return best, int(candidates[np.flatnonzero(length == best)[-1]])


def accepted_count(draft: list[int], samples: np.ndarray) -> int:
    """Greedy verification: the drafts up to the first that differs from the model's token at its place."""
    matches = np.asarray(draft) == samples[: len(draft)]
    return len(draft) if matches.all() else int(np.argmin(matches))


class Speculator:
    """The scheduler's speculative decoding: which requests draft, their drafts each step, what a verify accepted."""

    def __init__(self, config: EngineConfig) -> None:
        self.config: SpeculativeConfig = config.speculative_config
        self.counters = SpecStats(accepted_per_pos=[0] * self.config.num_speculative_tokens)
        suffix = self.config.method == "suffix"
        self.history = TokenHistory(self.config.suffix_decoding_max_cached_requests) if suffix else None

    def enroll(self, req: Request) -> None:
        """A new request drafts unless something in the sampler reads its tokens one at a time (penalties,
        logprobs, min_tokens, a grammar). A random row's verify samples are its own seeded draws at each place, so
        keeping the drafts up to the first that differs is rejection sampling: the same tokens as without drafts."""
        p = req.params
        penalties = p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
        if not penalties and p.logprobs is None and not p.min_tokens and p.structured_outputs is None:
            req.drafter = NgramDrafter(req.token_ids)

    def retire(self, req: Request) -> None:
        """A finished request's tokens, for later requests' suffix drafts."""
        if self.history is not None and self.history.max_requests:
            self.history.add(req.token_ids)

    def active(self, running: list[Request]) -> bool:
        """Rows may draft: a small batch (a large one is compute-bound), no grammar (masks count a sample per row)."""
        return len(running) <= self.config.disable_by_batch_size and all(req.matcher is None for req in running)

    def promising(self, req: Request) -> bool:
        """A request whose tokens so far (all but the one in flight) find drafts waits for that token to draft; one
        whose lookup finds none decodes on, its steps overlapped."""
        return req.drafter is not None and bool(self.propose(req.drafter.catch_up(req.token_ids), 1))

    def propose(self, drafter: NgramDrafter, k: int) -> list[int]:
        """Up to k tokens that followed the latest occurrence of the longest n-gram ending the request's tokens,
        in them or (suffix) in recent requests'; [] if none is long enough."""
        if k <= 0:
            return []
        spec, tokens, size = self.config, drafter.tokens, drafter.size
        suffix = self.history is not None
        longest, shortest = (
            (spec.suffix_decoding_max_tree_depth, 1) if suffix else (spec.prompt_lookup_max, spec.prompt_lookup_min)
        )
        pattern = tokens[max(0, size - longest) : size]
        length, at = longest_match(tokens[: size - 1], pattern)
        # A match that overlaps the request's end (a repeating stretch) goes on repeating its period.
        draft = np.resize(tokens[at + 1 : size], k) if length else tokens[:0]
        if suffix:
            factor = spec.suffix_decoding_max_spec_factor
            elsewhere, end = longest_match(self.history.tokens, pattern)
            # A cached request's continuation is seen, not extrapolated: it wins a tie with a repeated period.
            if elsewhere > length or (elsewhere == length and size - 1 - at < min(k, int(factor * length))):
                length, draft = elsewhere, self.history.tokens[end + 1 :]
            k = min(k, int(factor * length))
        if length < shortest or k == 0:
            return []
        ends = np.flatnonzero(draft[:k] < 0)  # a cached request's end
        return draft[: ends[0] if len(ends) else k].tolist()

    def draft(self, req: Request, budget: int, max_model_len: int) -> list[int]:
        """Its drafts, at most what its max_tokens, max_model_len and the step's budget leave room for (the token
        after them counts too); a request whose lookups find nothing for long stops drafting."""
        generated = req.num_tokens - req.num_prompt_tokens
        room = min(req.max_tokens - generated, max_model_len - req.num_tokens, budget) - 1
        draft = self.propose(req.drafter.catch_up(req.token_ids), min(self.config.num_speculative_tokens, room))
        if not draft and not req.drafter.settle(EMPTY_LOOKUP_GAIN):
            req.drafter = None
        return draft

    def accept(self, req: Request, draft: list[int], samples: np.ndarray) -> list[int]:
        """A verify row's accepted drafts, then the model's next token (a row reset without drafts: that one only)."""
        if not draft:
            return samples[:1].tolist()
        accepted = accepted_count(draft, samples)
        req.num_computed_tokens += accepted  # the accepted drafts' KV was written; the rest is written over later
        self.counters.count(len(draft), accepted)
        if req.drafter is not None and not req.drafter.settle(accepted):
            req.drafter = None
        return samples[: accepted + 1].tolist()

    def stats(self) -> dict:
        return self.counters.as_dict()


@dataclass(slots=True)
class SpecStats:
    """vLLM's spec-decode counters: drafts, draft tokens, accepted tokens, and accepted tokens per position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # num_speculative_tokens zeros at first

    def count(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1

    def as_dict(self) -> dict:
        return {f"spec_{name}": value for name, value in asdict(self).items()}
