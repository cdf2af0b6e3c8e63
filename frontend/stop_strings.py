"""Stop strings matched on the streamed text: never emit a stop string, nor any part of one that may complete."""
from __future__ import annotations


class StopMatcher:
    """Cuts the streamed text at the earliest stop string: before it, or after it when kept (vLLM's
    include_stop_str_in_output, which then holds nothing back).

    Invariant: `_tail` is the last (longest stop - 1) characters seen, and its last `_held` are not emitted yet: the
    longest suffix that is a proper prefix of some stop string (0 when stops are kept). A stop counts when it ends
    in a new delta; it cannot start before the held characters, or a longer suffix would have been held.
    """

    def __init__(self, stops: list[str] | None, keep_stop: bool = False) -> None:
        self.stops = [s for s in (stops or []) if s]
        self.keep_stop = keep_stop
        self._max_prefix = max((len(s) for s in self.stops), default=1) - 1
        self._tail = ""
        self._held = 0
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
            return text[start:cut + len(hit) if self.keep_stop else cut], hit
        self._held = 0 if self.keep_stop else self._partial_stop_len(text)
        self._tail = text[max(len(text) - self._max_prefix, 0):]
        return text[start:len(text) - self._held], None

    def flush(self) -> str:
        """The held text, when the request ends without a stop string."""
        held = self._tail[len(self._tail) - self._held:] if self._held else ""
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
            tail = text[len(text) - k:]
            if any(stop.startswith(tail) for stop in self.stops):
                return k
        return 0
