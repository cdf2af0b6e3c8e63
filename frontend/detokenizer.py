"""Incremental detokenization (token ids in, new text out) and the stop strings cut from that text."""

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
    """Output tokens as text deltas, holding back a character split across tokens. Invariant:
    ids[prefix_offset:read_offset] is text already emitted (kept as left context), ids[read_offset:] is not; a step
    decodes only ids[prefix_offset:], the context plus the tokens held back, not the whole sequence."""

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        # Hugging Face's slow tokenizers honour the spaces flag; fast ones (Qwen's) ignore it, as they do in vLLM.
        self._decode_flags = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])  # the context, then every output token
        self._prefix_offset, self._read_offset = 0, len(self._ids)

    def step(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they complete ("" while a multi-byte character is still split)."""
        self._ids.extend(new_token_ids)
        return self._emit(hold_incomplete=True)

    def flush(self) -> str:
        """At the end of a request: the text still held back (an incomplete character decodes as U+FFFD)."""
        return self._emit(hold_incomplete=False)

    def _emit(self, hold_incomplete: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or (hold_incomplete and new_text.endswith(_INCOMPLETE)):
            return ""  # nothing new (a skipped special token), or the last character's bytes are not all here
        delta = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
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

    def step(self, new_token_ids: list[int]) -> str:
        delta = ""
        for token in new_token_ids:
            self._held.append(token)
            piece = self._stream.step(self._backend, token)
            if piece is not None:
                delta += piece
                self._held.clear()
        return delta

    def flush(self) -> str:
        held, self._held = self._held, []
        return self._backend.decode(held, skip_special_tokens=self._skip) if held else ""


def make_detokenizer(
    tokenizer: PreTrainedTokenizerBase,
    prompt_token_ids: list[int],
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
) -> IncrementalDetokenizer | StreamDetokenizer:
    """DecodeStream (one native call per token) where it decodes as tokenizer.decode does; else the windowed decode."""
    if getattr(tokenizer, "backend_tokenizer", None) is not None and not tokenizer.clean_up_tokenization_spaces:
        return StreamDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens, spaces_between_special_tokens)


class StopMatcher:
    """Cuts the streamed text at the earliest stop string: before it, or after it when kept (vLLM's
    include_stop_str_in_output, which then holds nothing back). Invariant: `_tail` is the last (longest stop - 1)
    characters seen, and its last `_held` are not emitted yet: the longest suffix that is a proper prefix of some
    stop string (0 when stops are kept). A stop counts when it ends in a new delta; it cannot start before the held
    characters, or a longer suffix would have been held."""

    def __init__(self, stops: list[str] | None, keep_stop: bool = False) -> None:
        self.stops = [s for s in (stops or []) if s]
        self.keep_stop = keep_stop
        self._max_prefix = max((len(s) for s in self.stops), default=1) - 1
        self._tail, self._held = "", 0
        self.stopped: str | None = None

    def feed(self, delta: str, check: bool = True) -> tuple[str, str | None]:
        """(text safe to emit now, the stop string that matched or None). check=False (before min_tokens): no stop
        ends the text, but a stop's start is still held, so that a later delta can complete it."""
        if self.stopped is not None:
            return "", self.stopped
        text = self._tail + delta
        start = len(self._tail) - self._held  # the first character not emitted yet
        cut, hit = self._earliest_stop(text, len(self._tail)) if check else (len(text), None)
        if hit is not None:
            self._tail, self._held, self.stopped = "", 0, hit
            return text[start : cut + len(hit) if self.keep_stop else cut], hit
        self._held = 0 if self.keep_stop else self._partial_stop_len(text)
        self._tail = text[max(len(text) - self._max_prefix, 0) :]
        return text[start : len(text) - self._held], None

    def flush(self) -> str:
        """The held text, when the request ends without a stop string."""
        held = self._tail[len(self._tail) - self._held :] if self._held else ""
        self._held = 0
        return held

    def _earliest_stop(self, text: str, seen: int) -> tuple[int, str | None]:
        """(start, stop string) of the earliest stop that ends past text[:seen], the text checked before."""
        cut, hit = len(text), None
        for stop in self.stops:
            i = text.find(stop, max(seen - len(stop) + 1, 0), cut + len(stop) - 1)
            if i != -1 and i < cut:
                cut, hit = i, stop
        return cut, hit

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of text that a stop string starts with."""
        for k in range(min(self._max_prefix, len(text)), 0, -1):
            tail = text[len(text) - k :]
            if any(stop.startswith(tail) for stop in self.stops):
                return k
        return 0
