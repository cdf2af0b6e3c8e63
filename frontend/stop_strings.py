"""Stop strings matched on the streamed text: never emit a stop string, nor any part of one that may complete."""
from __future__ import annotations


class StopMatcher:
    """Feeds text deltas through; cuts the text at the earliest stop string: before it, or after it when the
    stop string is kept (vLLM's include_stop_str_in_output, which then holds nothing back).

    Invariant: `_tail` is the last (longest stop - 1) characters of the text seen so far, and its last `_held` of
    them are not emitted yet: the longest suffix of the text that is a proper prefix of some stop string (0 when
    stops are kept). A stop string counts when it ends in a new delta (as in vLLM: text before min_tokens stays
    unchecked); it cannot start before the held characters, or a longer suffix would have been held.
    """

    def __init__(self, stops: list[str] | None, keep_stop: bool = False) -> None:
        self.stops = [s for s in (stops or []) if s]
        self.keep_stop = keep_stop
        self._max_prefix = max((len(s) for s in self.stops), default=1) - 1
        self._tail = ""
        self._held = 0
        self.stopped: str | None = None

    def feed(self, delta: str, check: bool = True) -> tuple[str, str | None]:
        """Return (text safe to emit now, the stop string that matched or None). With check=False (before
        min_tokens, as vLLM does) no stop ends the text, but a stop's start is still held: one that a later
        delta completes is a match."""
        if self.stopped is not None:
            return "", self.stopped
        text = self._tail + delta
        start = len(self._tail) - self._held  # the first character not emitted yet
        cut, hit = self._earliest_stop(text, len(self._tail)) if check else (len(text), None)
        if hit is not None:
            self._tail, self._held, self.stopped = "", 0, hit
            return text[start:cut + len(hit) if self.keep_stop else cut], hit
        self._held = 0 if self.keep_stop else self._partial_stop_len(text)
        self._tail = text[max(len(text) - self._max_prefix, 0):]
        return text[start:len(text) - self._held], None

    def flush(self) -> str:
        """The held text, when the request ends without a stop string (it was not one after all)."""
        held = self._tail[len(self._tail) - self._held:] if self._held else ""
        self._held = 0
        return held

    def _earliest_stop(self, text: str, seen: int) -> tuple[int, str | None]:
        """(start, stop string) of the earliest stop that ends past text[:seen], the text checked before."""
        cut, hit = len(text), None
        for stop in self.stops:
            # only a match that ends in the new text and starts before the best so far
            i = text.find(stop, max(seen - len(stop) + 1, 0), cut + len(stop) - 1)
            if i != -1 and i < cut:
                cut, hit = i, stop
        return cut, hit

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of text that some stop string starts with (0 if none)."""
        for k in range(min(self._max_prefix, len(text)), 0, -1):
            tail = text[len(text) - k:]
            if any(stop.startswith(tail) for stop in self.stops):
                return k
        return 0
