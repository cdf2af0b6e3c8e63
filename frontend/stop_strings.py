"""Stop strings matched on the streamed text: never emit a stop string, nor any part of one that may complete."""
from __future__ import annotations


class StopMatcher:
    """Feeds text deltas through; cuts the text before the earliest stop string.

    Invariant: the held tail is the longest suffix of the text seen so far that is a proper prefix of some stop
    string. Every earlier position was checked, so a stop string can only start inside the held tail or later.
    """

    def __init__(self, stops: list[str] | None) -> None:
        self.stops = [s for s in (stops or []) if s]
        self._max_prefix = max((len(s) for s in self.stops), default=1) - 1
        self._held = ""
        self.stopped: str | None = None

    def feed(self, delta: str, check: bool = True) -> tuple[str, str | None]:
        """Return (text safe to emit now, the stop string that matched or None). With check=False (before
        min_tokens, as vLLM does) no stop ends the text, but a stop's start is still held: one that a later
        delta completes is a match."""
        if self.stopped is not None:
            return "", self.stopped
        text = self._held + delta
        cut, hit = self._earliest_stop(text) if check else (len(text), None)
        if hit is not None:
            self._held, self.stopped = "", hit
            return text[:cut], hit
        keep = self._partial_stop_len(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], None

    def flush(self) -> str:
        """The held tail, when the request ends without a stop string (it was not one after all)."""
        held, self._held = self._held, ""
        return held

    def _earliest_stop(self, text: str) -> tuple[int, str | None]:
        cut, hit = len(text), None
        for stop in self.stops:
            i = text.find(stop, 0, cut + len(stop) - 1)  # only a match that starts before the best so far
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
