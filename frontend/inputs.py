"""Prompt preparation at the frontend's entry: tokenize, then the same checks the scheduler runs on the wire."""
from __future__ import annotations

from typing import TYPE_CHECKING

from protocol.config import InvalidParam
from protocol.sampling import SamplingParams, check_length, check_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Prompt = str | list[int]


def prepare_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt, params: SamplingParams, max_model_len: int,
                   vocab_size: int) -> tuple[str | None, list[int]]:
    """Return (text, token ids); InvalidParam names the field that is wrong and the fix."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidParam("prompt", "prompt is empty: send at least one character or token id")
        text, ids = prompt, tokenizer.encode(prompt)  # the tokenizer's own specials: Llama 3's BOS, none for Qwen
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        text, ids = None, check_prompt(prompt, vocab_size)
    else:
        raise InvalidParam("prompt", f"prompt must be a str or a list of int token ids, got {type(prompt).__name__}")
    params.check_vocab(vocab_size)
    check_length(len(ids), params.max_tokens, max_model_len)
    return text, ids
