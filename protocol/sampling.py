"""SamplingParams and a request's checks against the model, run once at each entry point (frontend, socket)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

import numpy as np

from protocol.config import ContextTooLong, InvalidParam, is_int, require
from protocol.messages import RowSampling

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 1024  # entries: each is applied on the device every step
CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


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
    prompt_logprobs: int | None = None  # top logprobs of each prompt token past the first (0: its own only)
    logit_bias: dict[int, float] | None = None  # token id (or its digits) -> added to its logit (OpenAI's -100..100)
    # How the frontend turns tokens into text (vLLM's names and defaults); the engine ignores them.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # only slow (Python) tokenizers honour it, as in vLLM
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token's text) ending the text
    # vLLM's shape: one of json (a schema), json_object, regex, choice, grammar (EBNF) or structural_tag (xgrammar's
    # JSON), and any_whitespace (JSON's free whitespace; off by default, so a model cannot stall in spaces); ours:
    # after, a text such as "</think>" before which the output is free (a reasoning model's thoughts).
    structured_outputs: dict | None = None

    def __post_init__(self) -> None:
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        for name, valid, fix in _RULES:
            require(valid(getattr(self, name)), name, getattr(self, name), fix)
        require(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            f"use at most max_tokens={self.max_tokens}",
        )
        self.logit_bias = {int(t): float(b) for t, b in (self.logit_bias or {}).items()} or None
        self.structured_outputs = check_structured_outputs(self.structured_outputs)
        require(
            self.structured_outputs is None or self.min_tokens == 0,
            "min_tokens",
            self.min_tokens,
            "use 0 with structured_outputs: a grammar that ends would leave no token min_tokens allows",
        )

    def check_vocab(self, vocab_size: int) -> None:
        bad = sorted(t for t in self.logit_bias or {} if t >= vocab_size)
        require(
            not bad,
            "logit_bias",
            self.logit_bias,
            f"token id {bad[0] if bad else 0} is outside the vocabulary [0, {vocab_size}): use this model's ids",
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        """Build from a wire map; an unknown key (a typo) is an error."""
        if not isinstance(d, dict):
            raise InvalidParam("params", f"sampling params must be a map, got {type(d).__name__}")
        if unknown := sorted(set(d) - (known := {f.name for f in fields(cls)})):
            raise InvalidParam(str(unknown[0]), f"unknown sampling params {unknown}: known ones are {sorted(known)}")
        return cls(**d)

    def row_sampling(self) -> RowSampling:
        """What the worker samples this request with; the scheduler resolves seed and stop_token_ids first."""
        return RowSampling(
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=max(self.top_k, 0),
            min_p=float(self.min_p),
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty),
            seed=((self.seed or 0) + 2**63) % 2**64 - 2**63,  # SamplingParams allows -2**63 .. 2**64-1
            logprobs=-1 if self.logprobs is None else self.logprobs,
            prompt_logprobs=-1 if self.prompt_logprobs is None else self.prompt_logprobs,
            min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids if self.min_tokens else [],
            logit_bias=self.logit_bias or {},
            grammar=self.structured_outputs is not None,
        )


def check_structured_outputs(spec: object) -> dict | None:
    """None, or {kind: value as text, "any_whitespace": bool, "after" if given} for one kind of CONSTRAINT_KINDS."""
    if spec is None:
        return None
    fix = (
        f"send a map with exactly one of {list(CONSTRAINT_KINDS)} (json: a schema; json_object: true; regex, "
        "grammar, structural_tag: a string; choice: a list of strings) and optionally any_whitespace: bool and "
        "after: a string"
    )
    require(isinstance(spec, dict), "structured_outputs", spec, fix)
    kinds = [k for k in CONSTRAINT_KINDS if spec.get(k) not in (None, False)]
    require(
        len(kinds) == 1 and set(spec) <= {*CONSTRAINT_KINDS, "any_whitespace", "after"}, "structured_outputs", spec, fix
    )
    kind, value = kinds[0], spec[kinds[0]]
    if kind in ("json", "structural_tag") and isinstance(value, dict):
        value = json.dumps(value)
    ok = {
        "json_object": value is True,
        "choice": isinstance(value, list) and value and all(isinstance(c, str) and c for c in value),
    }.get(kind, isinstance(value, str) and value != "")
    require(ok and isinstance(spec.get("any_whitespace", False), bool), "structured_outputs", spec, fix)
    require(isinstance(spec.get("after", ""), str), "structured_outputs", spec, fix)
    checked = {kind: value, "any_whitespace": spec.get("any_whitespace", False)}
    return {**checked, "after": spec["after"]} if spec.get("after") else checked


def _is_token_key(v: object) -> bool:
    """A token id as a map key: an int, or its decimal digits (JSON and JavaScript objects have string keys)."""
    return is_int(v) and v >= 0 or isinstance(v, str) and v.isascii() and v.isdigit() and len(v) <= 9


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


_BOOL = (lambda v: isinstance(v, bool), "use true or false")
_LOGPROBS = (lambda v: v is None or (is_int(v) and 0 <= v <= MAX_LOGPROBS), f"use 0..{MAX_LOGPROBS} or None")
_RULES = (  # field, valid, fix: one InvalidParam naming the field each
    ("n", lambda v: is_int(v) and 1 <= v <= MAX_N, f"use 1..{MAX_N}"),
    ("temperature", lambda v: _is_num(v) and 0.0 <= v <= 100.0, "use 0 (greedy) up to 100"),
    ("top_p", lambda v: _is_num(v) and 0.0 < v <= 1.0, "use a value in (0, 1]"),
    ("top_k", lambda v: is_int(v) and v >= -1, "use -1 or 0 (off) or a positive k"),
    ("min_p", lambda v: _is_num(v) and 0.0 <= v <= 1.0, "use a value in [0, 1]"),
    ("seed", lambda v: v is None or (is_int(v) and -(2**63) <= v < 2**64), "use an integer or None"),
    ("max_tokens", lambda v: v is None or (is_int(v) and v >= 1), "use at least 1 (None: what the context allows)"),
    ("min_tokens", lambda v: is_int(v) and v >= 0, "use 0 or more"),
    (
        "stop",
        lambda v: len(v) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in v),
        f"use at most {MAX_STOP_STRINGS} non-empty strings",
    ),
    ("stop_token_ids", lambda v: all(t >= 0 for t in v), "use non-negative token ids"),
    ("presence_penalty", lambda v: _is_num(v) and -2.0 <= v <= 2.0, "use a value in [-2, 2]"),
    ("frequency_penalty", lambda v: _is_num(v) and -2.0 <= v <= 2.0, "use a value in [-2, 2]"),
    ("repetition_penalty", lambda v: _is_num(v) and 0.0 < v <= 2.0, "use a value in (0, 2]"),
    (
        "logit_bias",
        lambda v: (
            v is None
            or (
                isinstance(v, dict)
                and len(v) <= MAX_LOGIT_BIAS
                and all(_is_token_key(t) and _is_num(b) and -100.0 <= b <= 100.0 for t, b in v.items())
            )
        ),
        f"use at most {MAX_LOGIT_BIAS} entries of a token id >= 0 (an int, or its digits as a string) and a bias in "
        "[-100, 100]",
    ),
    ("skip_special_tokens", *_BOOL),
    ("spaces_between_special_tokens", *_BOOL),
    ("include_stop_str_in_output", *_BOOL),
    ("logprobs", *_LOGPROBS),
    ("prompt_logprobs", *_LOGPROBS),
)


def check_prompt(token_ids: object, vocab_size: int) -> list[int]:
    """A prompt's token ids as a list: at least one, each inside the vocabulary."""
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
        raise InvalidParam(
            "prompt",
            f"prompt must be a non-empty list of token ids, got shape {ids.shape} of "
            f"{ids.dtype}: send at least one token id",
        )
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise InvalidParam(
            "prompt",
            f"prompt token id {int(bad[0])} is outside the vocabulary [0, {vocab_size}): "
            "tokenize with this model's tokenizer",
        )
    return ids.tolist()


def check_length(prompt_len: int, max_tokens: int | None, max_model_len: int) -> int:
    """The request's max_tokens (None: what the context leaves), or ContextTooLong past max_model_len."""
    if prompt_len >= max_model_len:
        raise ContextTooLong(
            "prompt",
            f"prompt has {prompt_len} tokens, at or over max_model_len={max_model_len}: "
            "shorten it or raise max_model_len",
        )
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise ContextTooLong(
            "max_tokens",
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = "
            f"{prompt_len + max_tokens} is over max_model_len={max_model_len}: "
            "lower max_tokens or shorten the prompt",
        )
    return max_tokens
