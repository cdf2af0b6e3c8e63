"""Incremental detokenization: token ids in, newly completed text out, O(1) amortized per token."""
from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# How many prompt tokens to decode as context for the first output token (vLLM's choice): enough for
# tokenizers whose decoding of a token depends on its left neighbour (SentencePiece's leading space).
PROMPT_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"  # what decode gives for an incomplete UTF-8 sequence at the end


class IncrementalDetokenizer:
    """Turns a request's output tokens into text deltas, holding back a character split across tokens.

    Invariant: ids[prefix_offset:read_offset] is text already emitted (kept as left context), and
    ids[read_offset:] is not emitted yet. Each step decodes only ids[prefix_offset:], a window that is as long
    as the context plus the tokens held back, not the whole sequence.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        # Hugging Face's slow tokenizers honour the spaces flag; fast ones (Qwen's) ignore it, as they do in vLLM.
        self._decode_flags = {"skip_special_tokens": skip_special_tokens,
                              "spaces_between_special_tokens": spaces_between_special_tokens}
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])  # the context, then every output token
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._pieces: list[str] = []

    def step(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they complete ("" while a multi-byte character is still split)."""
        self._ids.extend(new_token_ids)
        return self._emit(hold_incomplete=True)

    def flush(self) -> str:
        """At the end of a request: the text still held back (an incomplete character decodes as U+FFFD)."""
        return self._emit(hold_incomplete=False)

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def _emit(self, hold_incomplete: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or (hold_incomplete and new_text.endswith(_INCOMPLETE)):
            return ""  # nothing new (a skipped special token), or the last character's bytes are not all here
        delta = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._pieces.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self._decode_flags) if ids else ""


class StreamDetokenizer:
    """IncrementalDetokenizer's deltas from tokenizers' DecodeStream, which keeps the window in Rust."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]:  # the same left context, its text dropped
            self._stream.step(self._backend, token)
        self._held: list[int] = []  # ids of a character still split (the stream has not emitted them)
        self._pieces: list[str] = []

    def step(self, new_token_ids: list[int]) -> str:
        delta = ""
        for token in new_token_ids:
            self._held.append(token)
            piece = self._stream.step(self._backend, token)
            if piece is not None:
                delta += piece
                self._held.clear()
        return self._emitted(delta)

    def flush(self) -> str:
        held, self._held = self._held, []
        return self._emitted(self._backend.decode(held, skip_special_tokens=self._skip) if held else "")

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def _emitted(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
        return delta


def make_detokenizer(tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                     spaces_between_special_tokens: bool = True) -> IncrementalDetokenizer | StreamDetokenizer:
    """tokenizers' DecodeStream (one native call per token) where it decodes as tokenizer.decode does: a fast
    tokenizer (which ignores the spaces flag) that does not clean up spaces; the windowed decode otherwise."""
    if getattr(tokenizer, "backend_tokenizer", None) is not None and not tokenizer.clean_up_tokenization_spaces:
        return StreamDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens, spaces_between_special_tokens)
