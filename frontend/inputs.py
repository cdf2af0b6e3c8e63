"""Prompt preparation at the boundary: tokenize, validate, and fill max_tokens from the context."""
from __future__ import annotations

import dataclasses

from protocol.sampling import SamplingParams

Prompt = str | list[int]


def prepare_prompt(tokenizer, prompt: Prompt, params: SamplingParams, max_model_len: int,
                   vocab_size: int) -> tuple[str | None, list[int], SamplingParams]:
    """Return (text, token ids, params with max_tokens set); ValueError names what is wrong and the fix."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty: send at least one character or token id")
        text, ids = prompt, tokenizer.encode(prompt, add_special_tokens=False)
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        text, ids = None, list(prompt)
        if not ids:
            raise ValueError("prompt is empty: send at least one character or token id")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    else:
        raise ValueError(f"prompt must be a str or a list of int token ids, got {type(prompt).__name__}")
    params.check_vocab(vocab_size)
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens, at or over max_model_len={max_model_len}: "
                         "shorten it or raise --max-model-len")
    if params.max_tokens is None:
        return text, ids, dataclasses.replace(params, max_tokens=max_model_len - len(ids))
    if len(ids) + params.max_tokens > max_model_len:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                         f"{len(ids) + params.max_tokens} is over max_model_len={max_model_len}: "
                         "lower max_tokens or shorten the prompt")
    return text, ids, params
