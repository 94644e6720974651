"""Drafts learned across requests: a bounded store of earlier requests' text (prompts and answers),
indexed by hashed n-grams, that offers what followed the text's latest n-gram elsewhere (vLLM's
suffix decoding, llama.cpp's shared ngram pools).

`SuffixStore` holds at most `capacity` tokens in a ring (the oldest go first), each finished
request's prompt and answer as one document. Every position is chained to the previous one whose
`NGRAM` tokens before it hash the same (zlib's hash chains), so an offer walks back from the most
recent occurrence of the text's last n-gram, compares up to `CANDIDATES` of them, and offers the
continuation of the one whose text before it agrees longest with the text's (the latest on a tie),
cut where the candidates whose match is at least half as long stop agreeing with it: a continuation many documents share runs long,
one that varies stops where it varies. A short n-gram's latest occurrences are often only the text
many documents share (a format's field name, a chat template's turn marker), the one document that
goes on as this text does lying further back; so the latest occurrence of the text's last `LONG`
tokens is a candidate too (a second table, of heads only). Memory: 4 bytes a token of text, 8 of
chain, 8 a bucket of each table (as many buckets as the capacity rounded up to a power of two):
about 28 MB a million tokens.

`SuffixPools` keeps one store per pool (an API key's requests; a server without keys has one), so
drafts never carry one client's text into another's timing.
"""

from __future__ import annotations

import array
import dataclasses
import threading
from typing import Callable, Iterable, Sequence

import numpy as np

from localspec.outputs import DraftSource
from localspec.speculative.plan import NO_OFFER, DraftPlan, Found, Offer
from localspec.speculative.ngram import MATCH_CAP
from localspec.speculative.lookup import found_draft, usable
from localspec.speculative.proposers import EMPTY_DRAFT, Proposer, ProposeSteps, _Drives
from localspec.speculative.sampling import SamplingParams

NGRAM = 3  # tokens a match needs at least (and the n-gram the chains are keyed by)
LONG = 16  # the long n-gram: its latest occurrence is compared beside the short one's
CANDIDATES = 8  # earlier occurrences compared per offer (the latest first)
AGREEMENT = 0.5  # a continuation is cut where fewer than this share of the candidates still agree
SENTINEL = -1  # between documents: never a token, so no match or continuation runs across one
_MIX = np.uint64(0x9E3779B97F4A7C15)  # a multiplier that spreads consecutive ids over the table


class SuffixStore:
    """The text of earlier requests, for suffix matches (see the module)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a suffix store holds at least one token")
        self.capacity = capacity
        self.ring = np.full(capacity, SENTINEL, dtype=np.int32)  # [capacity] tokens, by position % capacity
        # the chains, as array.array: read one entry at a time from Python (3x quicker than numpy's)
        self.prev = array.array("q", bytes(8 * capacity))  # [capacity] the previous position of the same hash
        size = 1 << max(10, (capacity - 1).bit_length())
        self.heads = array.array("q", bytes(8 * size))  # [size] the latest position of each hash bucket (0: none)
        self.long_heads = np.zeros(size, dtype=np.int64)  # [size] the same, of the LONG-token n-grams
        self.mask = size - 1
        self.end = 0  # positions written so far (absolute: position p is in ring[p % capacity])
        self.documents = 0
        self.lock = threading.Lock()  # added to by the engine's thread, read by a resuming batch's warm-up too

    @property
    def tokens(self) -> int:
        """Tokens held (documents' separators included)."""
        return min(self.end, self.capacity)

    @property
    def nbytes(self) -> int:
        return self.ring.nbytes + 8 * (len(self.prev) + len(self.heads)) + self.long_heads.nbytes

    def add(self, tokens: Sequence[int]) -> None:
        """Keep one document (a request's prompt and answer); the oldest text makes room for it."""
        doc = np.asarray(tokens, dtype=np.int32)[-(self.capacity - 1):]  # [n] what fits
        if len(doc) < NGRAM + 1:
            return
        with self.lock:
            start = self.end + 1  # a separator first
            positions = np.arange(self.end, start + len(doc))  # [n+1]
            self.ring[positions % self.capacity] = np.concatenate(([SENTINEL], doc))
            self.end = start + len(doc)
            self._chain(start + NGRAM + np.arange(len(doc) - NGRAM), _hashes(doc)[:-1])  # the last n-gram: nothing follows yet
            if len(doc) > LONG:
                buckets = (_hashes(doc, LONG)[:-1] & np.uint64(self.mask)).astype(np.int64)  # [n - LONG]
                last, first = np.unique(buckets[::-1], return_index=True)  # a bucket's latest occurrence wins
                self.long_heads[last] = start + LONG + (len(buckets) - 1 - first)
            self.documents += 1

    def _chain(self, positions: np.ndarray, keys: np.ndarray) -> None:
        """Link each of `positions` [m] (where a continuation starts) to the latest earlier one of
        its n-gram's bucket `keys` [m], in order."""
        buckets = (keys & np.uint64(self.mask)).astype(np.int64)  # [m]
        heads, prev, capacity = self.heads, self.prev, self.capacity
        for position, bucket in zip(positions.tolist(), buckets.tolist()):
            prev[position % capacity] = heads[bucket]
            heads[bucket] = position

    def offer(self, history: Sequence[int], limit: int) -> tuple[np.ndarray, int]:
        """(tokens, match length): what followed the best earlier occurrence of `history`'s last
        n-gram, at most `limit` tokens, and how many of the history's last tokens agree with the
        text before it (up to MATCH_CAP); (empty, 0) when there is none."""
        if limit <= 0 or len(history) < NGRAM:
            return _NOTHING
        n = min(len(history), MATCH_CAP)
        with self.lock:
            candidates = self._candidates(_hash_tail(history))
            if candidates and len(history) >= LONG:
                latest = self._long_candidate(history)
                if latest and latest not in candidates:
                    candidates.append(latest)
            if not candidates:
                return _NOTHING
            window = self._read(candidates, -n - 1, min(limit, MATCH_CAP))  # [c, n + 1 + L]
        back = history[-1:-n - 1:-1]  # [n] the last tokens, newest first
        last = np.array(back + [_NEVER] if isinstance(back, list) else [*back, _NEVER], dtype=np.int32)  # [n + 1]
        matched = (window[:, n::-1] != last).argmax(axis=1)  # [c] tokens before each that agree (the first differs)
        conts = window[:, n + 1:]  # [c, L]
        if matched.min() < NGRAM:  # a hash collision matches less
            keep = matched >= NGRAM
            if not keep.any():
                return _NOTHING
            conts, matched = conts[keep], matched[keep]
        best = int(matched.argmax())  # the latest on a tie
        peers = matched >= max(NGRAM, int(matched[best]) // 2)  # [c] what agrees about as far back as the best
        return _agreed(conts[peers], int(peers[:best].sum())), int(matched[best])

    @property
    def _oldest(self) -> int:
        """The first position the ring still holds (positions start at 1: 0 is "none" in the tables)."""
        return max(1, self.end - self.capacity)

    def _candidates(self, key: int) -> list[int]:
        """The positions following the latest occurrences of the n-gram hashed to `key` [<= CANDIDATES]."""
        oldest = self._oldest
        out = []
        position = self.heads[key & self.mask]
        while position >= oldest and len(out) < CANDIDATES:
            out.append(position)
            position = self.prev[position % self.capacity]
        return out

    def _long_candidate(self, history: Sequence[int]) -> int:
        """The position after the latest occurrence of `history`'s last LONG tokens (0: none, or
        a hash collision its first and last tokens tell apart)."""
        position = int(self.long_heads[_hash_tail(history, LONG) & self.mask])
        ring, capacity = self.ring, self.capacity
        if (position < self._oldest or ring[(position - 1) % capacity] != history[-1]
                or ring[(position - LONG) % capacity] != history[-LONG]):
            return 0
        return position

    def _read(self, candidates: list[int], start: int, stop: int) -> np.ndarray:
        """The tokens from `start` to `stop` around each candidate position [c, stop - start]
        (SENTINEL where the ring holds none: overwritten, or not written yet)."""
        at = np.array(candidates)[:, None] + _OFFSETS[MATCH_CAP + 1 + start:MATCH_CAP + 1 + stop]  # [c, stop - start]
        tokens = self.ring.take(at, mode="wrap")
        if min(candidates) + start < self.end - self.capacity or max(candidates) + stop > self.end:
            tokens[(at < self.end - self.capacity) | (at >= self.end)] = SENTINEL
        return tokens


_NEVER = -2  # compared with the text before a candidate: differs from every token and from SENTINEL
_OFFSETS = np.arange(-MATCH_CAP - 1, MATCH_CAP)  # positions around a candidate: the text before it, then after
_NOTHING = (np.zeros(0, dtype=np.int32), 0)


def _hashes(tokens: np.ndarray, n: int = NGRAM) -> np.ndarray:
    """The hash of each window of `n` consecutive `tokens` [m] -> [m - n + 1] (uint64)."""
    t = tokens.astype(np.uint64)
    h = np.zeros(len(t) - n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(n):
            h = (h ^ t[i:len(t) - n + 1 + i]) * _MIX
        return h ^ (h >> np.uint64(29))


def _hash_tail(history: Sequence[int], n: int = NGRAM) -> int:
    """`_hashes` of the last `n` tokens of `history`, in plain Python (an offer's hash)."""
    h = 0
    for token in history[-n:]:
        h = ((h ^ int(token)) * _MIX_INT) & _M64
    return h ^ (h >> 29)


_MIX_INT, _M64 = int(_MIX), (1 << 64) - 1


def _agreed(conts: np.ndarray, best: int) -> np.ndarray:
    """The best candidate's continuation [<= L], up to its end of document and to where fewer than
    AGREEMENT of the candidates still agree with every token of it so far."""
    chosen = conts[best]  # [L]
    same = conts == chosen  # [c, L]
    if same.all():  # one candidate, or all of them agree: to the end of the document
        ends = np.flatnonzero(chosen == SENTINEL)
        return chosen[:ends[0] if ends.size else len(chosen)].copy()
    alive = np.logical_and.accumulate(same, axis=1)  # [c, L] agreeing with all of it so far
    support = alive.sum(axis=0)  # [L]
    stop = (support < AGREEMENT * len(conts)) | (chosen == SENTINEL)  # [L]
    n = int(stop.argmax()) if stop.any() else len(chosen)
    return chosen[:n].copy()


class SuffixPools:
    """One `SuffixStore` per pool (e.g. an API key), each of `capacity` tokens; 0: no store."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._stores: dict[str, SuffixStore] = {}
        self._lock = threading.Lock()

    def store(self, pool: str = "", *, create: bool = False) -> SuffixStore | None:
        """`pool`'s store; None until something was kept for it (`create`: make it now), or when
        the cache is off. A store is made on first use: a one-shot run never pays for one."""
        if self.capacity <= 0:
            return None
        store = self._stores.get(pool)
        if store is None and create:
            with self._lock:
                store = self._stores.get(pool)
                if store is None:
                    store = self._stores[pool] = SuffixStore(self.capacity)
        return store

    def add(self, pool: str, documents: Iterable[Sequence[int]]) -> None:
        store = self.store(pool, create=True)
        if store is not None:
            for doc in documents:
                store.add(doc)

    def stats(self) -> dict[str, int]:
        with self._lock:
            stores = list(self._stores.values())
        return {"pools": len(stores), "tokens": sum(s.tokens for s in stores),
                "documents": sum(s.documents for s in stores), "bytes": sum(s.nbytes for s in stores)}


class SuffixProposer(_Drives):
    """The suffix cache beside another proposer (`inner`: a draft model, prompt lookup, both; None:
    the cache alone): its offer adds what the request's pool found to the inner one's, and a plan
    for `DraftSource.SUFFIX` drafts those tokens, any other plan goes to the inner proposer.

    `is_end`: the oracle's end-of-generation test (a continuation stops at one, as a lookup does)."""

    def __init__(self, inner: Proposer | None, pools: SuffixPools, *,
                 is_end: Callable[[int], bool] | None = None) -> None:
        self.inner, self.pools, self.is_end = inner, pools, is_end
        self.pool = ""  # the request's pool: its store is looked up at each offer (made when a request ends)
        self._last = DraftSource.NONE  # the source of the last draft

    @property
    def draft_context(self):
        return self.inner.draft_context if self.inner is not None else None

    def fork(self, seq: int) -> "SuffixProposer":
        return SuffixProposer(self.inner.fork(seq) if self.inner is not None else None, self.pools, is_end=self.is_end)

    def start(self, *, catch_up: bool, pool: str = "", prompt: int | None = None) -> None:
        self.pool = pool
        if self.inner is not None:
            self.inner.start(catch_up=catch_up, pool=pool, prompt=prompt)

    def describe(self) -> str:
        return self.inner.describe() if self.inner is not None else "suffix"

    def offer(self, history: Sequence[int], limit: int, constraint=None) -> Offer:
        inner = self.inner.offer(history, limit, constraint) if self.inner is not None else NO_OFFER
        store = self.pools.store(self.pool)
        if store is None or limit <= 0:
            return inner
        tokens, matched = store.offer(history, limit)  # [<= limit]
        tokens = usable(tokens, self.is_end, constraint)
        return dataclasses.replace(inner, suffix=Found(tokens, matched)) if len(tokens) else inner

    def propose_steps(self, history: Sequence[int], plan: DraftPlan, offer: Offer, sampling: SamplingParams,
                      rng: np.random.Generator, constraint=None) -> ProposeSteps:
        if plan.source == DraftSource.SUFFIX:
            if plan.resync and self.inner is not None:  # a re-try: the model's next draft sees all of the text
                yield from self.inner.propose_steps(history, DraftPlan(resync=True), offer, sampling, rng, constraint)
            self._last = DraftSource.SUFFIX
            return found_draft(offer.suffix, plan, constraint)
        if self.inner is None:
            return EMPTY_DRAFT
        if plan.source == DraftSource.MODEL and self._last == DraftSource.SUFFIX and not plan.probe:
            plan = dataclasses.replace(plan, resync=True)  # the model has not seen what the cache's drafts added
        if plan.drafts:
            self._last = plan.source
        return (yield from self.inner.propose_steps(history, plan, offer, sampling, rng, constraint))
