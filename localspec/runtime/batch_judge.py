"""Whether drafting pays for several sequences at once, as measured against plain batched decoding.

A pass that carries several sequences' one-token rows costs hardly more than a pass of one (the
weights are read once): plain batched decoding is already several times faster than one stream.
Each drafted token then adds its compute to the pass; where the pass is compute-bound (an F16 oracle
on a few CPU cores) or ragged rows split into several passes, drafting for every sequence can cost
the batch more than it gains, even at high acceptance. Measured on a 2-core Xeon VM, the oracle
widened to 1.45B parameters with the Q4_1 draft, four sequences of 128 tokens: a plain pass of four
tokens 0.19 s, drafting steps of 16-68 tokens 0.6-2.6 s, and the default drafted throughout, 0.71x
the oracle alone's plain batched decoding (benchmarks/widened-cpu/). The length policy prices a
draft for the shared pass from its learned costs, whose linear form cannot see that the first few
tokens of a pass are free, and which never measured a plain batched pass it never ran.

So the engine measures both, at each number of running sequences. The policies decide the first
steps at a size; where their drafting steps make fewer tokens per second than plain batching could at
best (`sequences` tokens a one-token pass: a pass of one-token rows costs no less than a pass of one),
one plain step measures plain batched decoding (which also teaches the pass costs what such a pass
costs). Drafting that beats that bound is never interrupted (a GPU with an expensive oracle). Once
enough drafting steps were seen, their rate is compared with plain steps'; where drafting is
measurably slower, steps at that size run plain, but for one drafting step every `RECHECK_EVERY`
(the text, its acceptance and the context move on). Only steps that fill no prompt count. A single
stream is the policy's alone (it measures and idles itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

SEEN_DRAFTING = 2  # drafting steps at a size before plain batching is measured there (if it may be faster)
MIN_DRAFTING = 8  # drafting steps measured at a size before a verdict
MARGIN = 0.10  # drafting must measure at least this much slower than plain to be switched off
DECAY = 0.95  # the weight of the earlier evidence at each new step (both rates follow drift)
RECHECK_EVERY = 16  # plain steps at a size between drafting re-checks once plain won there


@dataclass
class _Rate:
    """Exponentially weighted tokens per second of one kind of step at one batch size."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = DECAY * self.tokens + tokens
        self.seconds = DECAY * self.seconds + seconds
        self.steps += 1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class BatchJudge:
    """Plain or drafting, per number of running sequences, from measured steps (module docstring)."""

    def __init__(self) -> None:
        self._plain: dict[int, _Rate] = {}
        self._drafting: dict[int, _Rate] = {}
        self._since_check: dict[int, int] = {}  # plain steps since the last drafting one, where plain won

    def plain(self, sequences: int, one_token_pass: Callable[[], float | None] = lambda: None) -> bool:
        """Whether a step of `sequences` running sequences runs plain (no drafts at all).
        `one_token_pass()`: seconds of one sequence's one-token pass, as learned (None: unknown;
        asked only while plain batching at this size is not measured yet)."""
        if sequences < 2:
            return False
        drafting = self._drafting.get(sequences)
        if drafting is None or drafting.steps < SEEN_DRAFTING:
            return False  # the policies' drafts first (most steps, where drafting pays)
        if sequences not in self._plain:  # measure plain batching once, unless drafting beats its best
            seconds = one_token_pass()
            bound = sequences / seconds if seconds else None
            return bound is None or drafting.rate < (1.0 - MARGIN) * bound
        if not self.drafting_loses(sequences):
            return False
        return self._since_check.get(sequences, 0) < RECHECK_EVERY

    def drafting_loses(self, sequences: int) -> bool:
        """Whether drafting steps at this size measured slower than plain ones, by MARGIN."""
        plain, drafting = self._plain.get(sequences), self._drafting.get(sequences)
        if plain is None or drafting is None or drafting.steps < MIN_DRAFTING:
            return False
        return drafting.rate < (1.0 - MARGIN) * plain.rate

    def observe(self, sequences: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A step of `sequences` running sequences (no prompt filled in it): whether any of them
        drafted, the tokens it emitted and its seconds (drafting, verifying and the host's own)."""
        if sequences < 2 or seconds <= 0:
            return
        if drafted:
            self._drafting.setdefault(sequences, _Rate()).add(tokens, seconds)
            self._since_check[sequences] = 0
        else:
            self._plain.setdefault(sequences, _Rate()).add(tokens, seconds)
            self._since_check[sequences] = self._since_check.get(sequences, 0) + 1

    def describe(self) -> dict[int, tuple[float, float]]:
        """Tokens per second measured at each size: (plain, drafting; 0 where not measured)."""
        sizes = sorted(set(self._plain) | set(self._drafting))
        return {s: (self._plain[s].rate if s in self._plain else 0.0,
                    self._drafting[s].rate if s in self._drafting else 0.0) for s in sizes}
