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
enough drafting steps were seen, their rate is compared with plain steps'. Drafting keeps the steps
at that size only where it measures `WIN` faster than plain: a tie goes to plain batching, because
drafting also costs what its rate does not hold (the draft's prompt fills, a longer first token,
sequences that finish apart). Where drafting does not win, steps at that size run plain, but for one
drafting step every `RECHECK_EVERY` (the text, its acceptance and the context move on), twice as long
after each re-check that drafting lost too, up to `RECHECK_MAX` (a re-check after a stretch of plain
steps costs a catch-up of the draft besides: 0.6-1.4 s where a plain step took 0.24 s); where it
wins by less than the bound, one plain step every `REFRESH_EVERY` drafting steps keeps plain's rate
current (a rate measured once, in a noisy moment, would otherwise decide for good). Only steps that
fill no prompt count. A single stream is the policy's alone (it measures and idles itself).

Its rates are kept between processes with the learned costs (`state`, `load_state`: the cost
cache's "batch" kind, keyed by both models' costs' keys): a restarted server or a new `batch
--parallel` run starts knowing what plain batching and drafting made at each size here, where it had
spent eight drafting steps (12 s on that oracle) relearning it. A kept verdict is checked as any is:
plain is measured at its first step of a size, and drafting again after RECHECK_EVERY plain steps.

Served, four clients of that oracle, 128 tokens each, before the tie rule: drafting steps made 15.5
tokens/s at four sequences against 16.9 plain (inside the 10% margin a verdict then needed), and the
run made 0.89x `--no-draft`'s throughput (13.7 against 15.4 tokens/s, one run each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

SEEN_DRAFTING = 2  # drafting steps at a size before plain batching is measured there (if it may be faster)
MIN_DRAFTING = 8  # drafting steps measured at a size before a verdict
MARGIN = 0.10  # drafting this far under plain batching's best (the bound) may be slower than plain: measure plain
WIN = 0.05  # drafting must measure this much faster than plain to keep the steps of a size (a tie goes to plain)
DECAY = 0.95  # the weight of the earlier evidence at each new step (both rates follow drift)
RECHECK_EVERY = 16  # plain steps at a size before the first drafting re-check once plain won there
RECHECK_MAX = 256  # ... doubled after each re-check drafting lost, up to this
REFRESH_EVERY = 16  # drafting steps at a size between plain re-measurements, where drafting wins under the bound


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
        self._since_check: dict[int, int] = {}  # plain steps since the last drafting one
        self._recheck: dict[int, int] = {}  # plain steps between drafting re-checks, where plain won (backed off)
        self._since_plain: dict[int, int] = {}  # drafting steps since plain was measured, or out of reach

    def plain(self, sequences: int, one_token_pass: Callable[[], float | None] = lambda: None) -> bool:
        """Whether a step of `sequences` running sequences runs plain (no drafts at all).
        `one_token_pass()`: seconds of one sequence's one-token pass, as learned (None: unknown;
        asked only where plain batching at this size is due a measurement)."""
        if sequences < 2:
            return False
        drafting = self._drafting.get(sequences)
        if drafting is None or drafting.steps < SEEN_DRAFTING:
            return False  # the policies' drafts first (most steps, where drafting pays)
        if self._since_plain.get(sequences, REFRESH_EVERY) >= REFRESH_EVERY:
            # plain batching not measured at this size, or not lately: measure it, unless drafting beats its best
            seconds = one_token_pass()
            bound = sequences / seconds if seconds else None
            if bound is None or drafting.rate < (1.0 - MARGIN) * bound:
                return True
            self._since_plain[sequences] = 0  # beyond plain's reach: look again in REFRESH_EVERY drafting steps
        if drafting.steps < MIN_DRAFTING or sequences not in self._plain:
            return False
        if not self.drafting_loses(sequences):
            self._recheck.pop(sequences, None)
            return False
        return self._since_check.get(sequences, 0) < self._recheck.get(sequences, RECHECK_EVERY)

    def drafting_loses(self, sequences: int) -> bool:
        """Whether drafting steps at this size measured no faster than plain ones, by WIN."""
        plain, drafting = self._plain.get(sequences), self._drafting.get(sequences)
        if plain is None or drafting is None or drafting.steps < MIN_DRAFTING:
            return False
        return drafting.rate < (1.0 + WIN) * plain.rate

    def observe(self, sequences: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A step of `sequences` running sequences (no prompt filled in it): whether any of them
        drafted, the tokens it emitted and its seconds (drafting, verifying and the host's own)."""
        if sequences < 2 or seconds <= 0:
            return
        if drafted:
            interval = self._recheck.get(sequences, RECHECK_EVERY)
            recheck = self._since_check.get(sequences, 0) >= interval
            self._drafting.setdefault(sequences, _Rate()).add(tokens, seconds)
            if recheck and self.drafting_loses(sequences):  # lost again: the next re-check waits twice as long
                self._recheck[sequences] = min(2 * interval, RECHECK_MAX)
            self._since_check[sequences] = 0
            if sequences in self._since_plain:
                self._since_plain[sequences] += 1
        else:
            self._plain.setdefault(sequences, _Rate()).add(tokens, seconds)
            self._since_check[sequences] = self._since_check.get(sequences, 0) + 1
            self._since_plain[sequences] = 0

    def state(self) -> dict:
        """What was measured, to keep between processes: per size, each kind's weighted tokens,
        seconds and steps ({} where nothing was)."""
        sizes: dict[str, dict] = {}
        for kind, rates in (("plain", self._plain), ("drafting", self._drafting)):
            for s, r in rates.items():
                sizes.setdefault(str(s), {})[kind] = [r.tokens, r.seconds, r.steps]
        return {"sizes": sizes} if sizes else {}

    def load_state(self, state: dict) -> None:
        """Take what an earlier process measured (`state`); malformed entries raise ValueError,
        TypeError or KeyError and leave the judge as it was. The counts since the last plain or
        drafting step start afresh: plain is measured at the first step of a size, as its rate is due."""
        plain, drafting = {}, {}
        if not isinstance(state["sizes"], dict):
            raise TypeError(f"sizes: {state['sizes']!r}")
        for s, kinds in state["sizes"].items():
            size = int(s)
            for kind, into in (("plain", plain), ("drafting", drafting)):
                if kind in kinds:
                    tokens, seconds, steps = (float(x) for x in kinds[kind])
                    if not (tokens >= 0 and seconds > 0 and steps >= 1):
                        raise ValueError(f"a {kind} rate of {tokens} tokens in {seconds} s")
                    into[size] = _Rate(tokens, seconds, int(steps))
        self._plain.update(plain)
        self._drafting.update(drafting)

    def explain(self, sequences: int) -> str:
        """Why steps of `sequences` sequences ran plain, for people."""
        plain, drafting = self.describe().get(sequences, (0.0, 0.0))
        if plain and drafting:
            return (f"plain batched decoding of {sequences} sequences measured {plain:.1f} tokens/s, "
                    f"drafting {drafting:.1f}")
        return f"plain batched decoding of {sequences} sequences measured against drafting ({drafting:.1f} tokens/s)"

    def describe(self) -> dict[int, tuple[float, float]]:
        """Tokens per second measured at each size: (plain, drafting; 0 where not measured)."""
        sizes = sorted(set(self._plain) | set(self._drafting))
        return {s: (self._plain[s].rate if s in self._plain else 0.0,
                    self._drafting[s].rate if s in self._drafting else 0.0) for s in sizes}
