"""Token-by-token text assembly with stop strings.

`TextStream` turns emitted tokens into text (UTF-8 safe when a character spans tokens), finds stop
strings even when they span several tokens, and only releases text that can no longer turn out to
be the start of a stop string, so streamed text never contains one.

A labelled stream also says which token each piece of released text came from (`spans`): every
token added carries a label (where it came from: the draft, prompt lookup, the oracle), and the
released text is handed out again cut at the tokens' boundaries, each piece with its token's label.
The pieces follow the text exactly: held back with it, cut with it at a stop string, and a
character whose bytes span several tokens belongs to the token that completed it.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence


class TextStream:
    def __init__(self, feed: Callable[[int], str], flush: Callable[[], str], stops: Sequence[str] = (), *,
                 labelled: bool = False) -> None:
        self._feed = feed
        self._flush = flush
        self._stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self._stops), default=0)
        self.text = ""  # all text so far (cut at the stop string once one is found)
        self._released = 0  # chars of self.text already handed out
        self.stopped = False
        # labelled: where each token's text ended in self.text when it was added, and its label,
        # until `spans` has handed that text out (None: not kept, nothing to pay)
        self._ends: deque[tuple[int, str]] | None = deque() if labelled else None
        self._spanned = 0  # chars of self.text `spans` has handed out

    def add(self, token: int, label: str = "") -> bool:
        """Append one token; True when a stop string has just completed (text is cut before it).
        `label`: where the token came from (kept by a labelled stream)."""
        self._append(self._feed(token))
        if self._ends is not None:
            self._ends.append((len(self.text), label))
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
            if self._ends:  # what the detokenizer held (part of a character) ends the last token's text
                self._ends[-1] = (len(self.text), self._ends[-1][1])
        self.stopped = True
        return self.release()

    def spans(self) -> list[tuple[str, str]]:
        """The text released since the last call, as (piece, label) pairs: one per token that
        contributed to it, in order (a token whose text is all held back, cut off or empty has
        none). Call it after each `release` / `finish`: the pieces then add up to what it returned."""
        assert self._ends is not None, "spans() needs TextStream(..., labelled=True)"
        out, at, limit = [], self._spanned, self._released
        while self._ends and at < limit:
            end, label = self._ends[0]
            # a stop string cuts the text: a token's end may lie past what is left of it
            cut = min(end, limit)
            if cut > at:
                out.append((self.text[at:cut], label))
                at = cut
            if end > limit:  # the rest of this token's text is still held back (or was cut off)
                break
            self._ends.popleft()
        self._spanned = at
        return out

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:n]):
                    best = n
                    break
        return best
