"""Token-by-token text assembly with stop strings.

`TextStream` turns emitted tokens into text (UTF-8 safe when a character spans tokens), finds stop
strings even when they span several tokens, and only releases text that can no longer turn out to
be the start of a stop string, so streamed text never contains one.
"""

from __future__ import annotations

from typing import Callable, Sequence


class TextStream:
    def __init__(self, feed: Callable[[int], str], flush: Callable[[], str], stops: Sequence[str] = ()) -> None:
        self._feed = feed
        self._flush = flush
        self._stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self._stops), default=0)
        self.text = ""  # all text so far (cut at the stop string once one is found)
        self._released = 0  # chars of self.text already handed out
        self.stopped = False

    def add(self, token: int) -> bool:
        """Append one token; True when a stop string has just completed (text is cut before it)."""
        self._append(self._feed(token))
        return self.stopped

    def _append(self, piece: str) -> None:
        if not piece or self.stopped:
            return
        start = max(0, len(self.text) - self._longest + 1)
        self.text += piece
        if not self._stops:
            return
        hits = [i for i in (self.text.find(s, start) for s in self._stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def release(self) -> str:
        """Text that is final: everything except a tail that may still grow into a stop string."""
        end = len(self.text) if self.stopped else len(self.text) - self._held_back()
        out = self.text[self._released:end]
        self._released = max(self._released, end)
        return out

    def finish(self) -> str:
        """End of generation: flush the detokenizer and release everything left."""
        if not self.stopped:
            self._append(self._flush())
        self.stopped = True
        return self.release()

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:n]):
                    best = n
                    break
        return best
