"""SamplingParams and the checks of a request against the model, shared by both entry points (the frontend
and the scheduler's socket): each runs them once."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np

from protocol.config import ContextTooLong, InvalidParam, require

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 1024  # entries: each is applied on the device every step


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's -100..100)
    # How the frontend turns tokens into text (vLLM's names and defaults); the engine ignores them.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # only slow (Python) tokenizers honour it, as in vLLM
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token's text) ending the text

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        self._validate()
        self.logit_bias = {int(t): float(b) for t, b in (self.logit_bias or {}).items()} or None

    def _validate(self) -> None:
        require(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", self.n, f"use 1..{MAX_N}")
        require(_is_num(self.temperature) and 0.0 <= self.temperature <= 100.0, "temperature",
              self.temperature, "use 0 (greedy) up to 100")
        require(_is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", self.top_p, "use a value in (0, 1]")
        require(_is_int(self.top_k) and self.top_k >= -1, "top_k", self.top_k, "use -1 or 0 (off) or a positive k")
        require(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "use a value in [0, 1]")
        require(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**64), "seed", self.seed,
              "use an integer or None")
        require(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
              self.max_tokens, "use at least 1 (or None for as many as the context allows)")
        require(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", self.min_tokens, "use 0 or more")
        require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
              f"use at most max_tokens={self.max_tokens}")
        require(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"{len(self.stop)} strings",
              f"use at most {MAX_STOP_STRINGS}")
        require(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "use non-empty strings")
        require(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids,
              "use non-negative token ids")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            require(_is_num(value) and -2.0 <= value <= 2.0, name, value, "use a value in [-2, 2]")
        require(_is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
              self.repetition_penalty, "use a value in (0, 2]")
        require(self.logit_bias is None or _valid_bias(self.logit_bias), "logit_bias", self.logit_bias,
                f"use at most {MAX_LOGIT_BIAS} entries of a token id >= 0 and a bias in [-100, 100]")
        for name in ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output"):
            require(isinstance(getattr(self, name), bool), name, getattr(self, name), "use true or false")
        require(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
              "logprobs", self.logprobs, f"use 0..{MAX_LOGPROBS} or None")

    def check_vocab(self, vocab_size: int) -> None:
        """The token ids that must exist (logit_bias's) are inside [0, vocab_size)."""
        bad = sorted(t for t in self.logit_bias or {} if t >= vocab_size)
        require(not bad, "logit_bias", self.logit_bias,
                f"token id {bad[0] if bad else 0} is outside the vocabulary [0, {vocab_size}): use this model's ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        """Build from a wire map; unknown keys are an error so that a typo is not silently ignored."""
        if not isinstance(d, dict):
            raise InvalidParam("params", f"sampling params must be a map, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidParam(str(unknown[0]), f"unknown sampling params {unknown}: known ones are {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_plan(cls, d: dict) -> SamplingParams:
        """A NewRow's params, which the scheduler has already checked: built without checking them again."""
        params = object.__new__(cls)
        for f in fields(cls):
            setattr(params, f.name, d[f.name])
        params.logit_bias = {int(t): b for t, b in d["logit_bias"].items()} if d["logit_bias"] else None
        return params


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def _valid_bias(bias) -> bool:
    return (isinstance(bias, dict) and len(bias) <= MAX_LOGIT_BIAS
            and all(_is_int(t) and t >= 0 and _is_num(b) and -100.0 <= b <= 100.0 for t, b in bias.items()))


def check_prompt(token_ids: object, vocab_size: int) -> list[int]:
    """A prompt's token ids as a list: at least one, each inside the vocabulary."""
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
        raise InvalidParam("prompt", f"prompt must be a non-empty list of token ids, got shape {ids.shape} of "
                                     f"{ids.dtype}: send at least one token id")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise InvalidParam("prompt", f"prompt token id {int(bad[0])} is outside the vocabulary [0, {vocab_size}): "
                                     "tokenize with this model's tokenizer")
    return ids.tolist()


def check_length(prompt_len: int, max_tokens: int | None, max_model_len: int) -> int:
    """The request's max_tokens (None: what the context leaves), or ContextTooLong past max_model_len."""
    if prompt_len >= max_model_len:
        raise ContextTooLong("prompt", f"prompt has {prompt_len} tokens, at or over max_model_len={max_model_len}: "
                                       "shorten it or raise max_model_len")
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise ContextTooLong("max_tokens", f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = "
                                           f"{prompt_len + max_tokens} is over max_model_len={max_model_len}: "
                                           "lower max_tokens or shorten the prompt")
    return max_tokens
