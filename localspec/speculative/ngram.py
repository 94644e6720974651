"""Prompt lookup's search, on the text as an array: where the text's last n-gram occurred before
(longest n first), and which of those occurrences agrees longest with the text before it.

Each step of a request asks this once, so it is written for the common cases' cost: most steps'
last token never occurred before (one compare over the text), and most n-grams that did occur have
a handful of occurrences, which plain Python over the request's token list compares faster than
numpy calls can (each ~1-5 us of overhead on a small array); many occurrences go through numpy.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

MATCH_CAP = 64  # a lookup match is measured back at most this far
SOURCES_COMPARED = 32  # a lookup compares the latest this many occurrences of its n-gram
_FEW = 16  # occurrences up to which plain Python narrows and ranks them


def find_source(tokens: np.ndarray, text: Sequence[int] | None = None, *, max_ngram: int = 4,
                min_ngram: int = 2) -> tuple[int, int] | None:
    """Where a lookup draft of `tokens` [n] (the text so far) would copy from: the position after
    the best earlier occurrence of the text's longest last n-gram (min_ngram <= n <= max_ngram) that
    occurred, and how far back its agreement goes (`match_lengths`); None where none occurred.
    `text`: the same tokens as a list (indexed from Python on the small cases), or None."""
    if len(tokens) <= min_ngram:
        return None
    ends = (tokens[:-1] == tokens[-1]).nonzero()[0]  # [m] the earlier occurrences of the last token
    if not ends.size:
        return None  # (most steps of most texts: the cheapest way out)
    top = min(max_ngram, len(tokens) - 1)  # the longest n-gram that may count
    if text is not None and ends.size <= _FEW:
        found, n = _longest_few(text, ends.tolist(), top)
    else:
        found, n = _longest(tokens, ends, top)
    if n < min_ngram:
        return None
    return best_source(tokens, found[-SOURCES_COMPARED:] + 1, text)


def _longest(tokens: np.ndarray, found: np.ndarray, top: int) -> tuple[np.ndarray, int]:
    """The ends [m'] of the earlier occurrences of the longest last n-gram (n <= top) among those of
    the last token, `found` [m], and that n: each set of the last n+1 tokens' within the last n's."""
    n = 1
    while n < top:
        longer = found[found >= n]
        longer = longer[tokens[longer - n] == tokens[-1 - n]]  # [m'] ends of the last n+1 tokens
        if not longer.size:
            break
        found, n = longer, n + 1
    return found, n


def _longest_few(text: Sequence[int], ends: list[int], top: int) -> tuple[np.ndarray, int]:
    """`_longest` for a few occurrences: each one's agreement with the text's end, read backwards."""
    last = len(text) - 1
    agree = []
    for end in ends:
        j = 1
        while j < top and j <= end and text[end - j] == text[last - j]:
            j += 1
        agree.append(j)  # the last j tokens occur ending at `end`
    n = max(agree)
    return np.array([end for end, j in zip(ends, agree) if j >= n], dtype=np.int64), n


def best_source(tokens: np.ndarray, follows: np.ndarray, text: Sequence[int] | None = None) -> tuple[int, int]:
    """Of the candidate sources `follows` [m] (positions right after an occurrence of the text's last
    n-gram, oldest first), the one whose preceding tokens agree longest with the text's last ones,
    the latest on a tie; and that agreement's length (`match_lengths`). On the bench's 26 prompts
    (the default oracle's greedy answers, a guess at every position with a match) the guesses held
    for 13.2 tokens on average against 12.1 from the latest occurrence (grounded 12.6 vs 10.9, long
    7.9 vs 6.7, code 7.1 vs 6.9, copy 27.0 vs 26.3), their first token 81% of the time against 80%.
    `text`: the tokens as a list, for plain Python on a few candidates (or None)."""
    if text is not None and len(follows) <= _FEW:
        lengths = [_match_length_few(text, follow) for follow in follows.tolist()]
        held = max(lengths)
        best = len(lengths) - 1 - lengths[::-1].index(held)  # the latest of the longest
        return int(follows[best]), held
    lengths = match_lengths(tokens, follows)  # [m]
    best = len(follows) - 1 - int(np.argmax(lengths[::-1]))  # the latest of the longest
    return int(follows[best]), int(lengths[best])


def match_lengths(tokens: np.ndarray, follows: np.ndarray) -> np.ndarray:
    """How far each source agrees with the text's end, for each of `follows` [m], in one pass: [m],
    how many of the last tokens of `tokens` [n] equal the ones before the source (read backwards,
    up to MATCH_CAP)."""
    back = np.arange(min(MATCH_CAP, len(tokens)))  # [cap] steps back from a source, and from the end
    before = follows[:, None] - 1 - back  # [m, cap] positions read backwards from each source
    agree = (tokens[np.maximum(before, 0)] == tokens[len(tokens) - 1 - back]) & (before >= 0)  # [m, cap]
    agree = np.concatenate((agree, np.zeros((len(follows), 1), dtype=bool)), axis=1)  # [m, cap+1]
    return np.argmin(agree, axis=1)  # [m] the first disagreement


def _match_length_few(text: Sequence[int], follow: int) -> int:
    """`match_lengths` of one source, read from a list."""
    span, last = min(follow, MATCH_CAP), len(text) - 1
    i = 0
    while i < span and text[follow - 1 - i] == text[last - i]:
        i += 1
    return i
