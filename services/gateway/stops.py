"""Stop strings over a stream of text deltas.

Text that might be the start of a stop string is held back until it is known not to be one,
so a client never sees part of a stop string, and the stop string itself is never returned.
"""

from __future__ import annotations


class StopMatcher:
    """Feed text deltas; get back what is safe to emit, and whether a stop string was hit."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Return the text that can be sent now. After a stop string, always ''."""
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        text = self._held + delta
        cut = min((i for s in self.stops if (i := text.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._held = True, ""
            return text[:cut]
        keep = self._longest_partial(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The end of the stream: held-back text was not a stop string after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_partial(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
