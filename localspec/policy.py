"""Draft-length policies: how many tokens to draft in the next step.

The engine asks `draft_length(limit)` before each step and reports the outcome with `update(...)`,
so a policy can hide any schedule (fixed, cost-aware) behind two calls.

`AdaptiveLength` (the default) picks the draft allowance k that maximises expected tokens per second.
The draft may stop before k (its confidence cut-off, p_min; a lookup match that runs out), so

    P(draft token i+1 is proposed | token i was)    = c       (the continuation rate)
    P(tokens 1..i are all proposed and accepted)     = a^i * c_acc^(i-1)
    expected tokens per step   E(k) = 1 + sum_{i=1..k} a^i * c_acc^(i-1)
    time per step              T(k) = sum_l P(L = l | k) * (draft_cost(l) + verify_cost(l + 1)),  T(0) = verify_cost(1)

where L is the number of tokens drafted (P(L = l) = c^(l-1) * (1 - c) for l < k, c^(k-1) for l = k),
a the running acceptance rate of a draft token given the ones before it were accepted (each drafted
token up to the first rejection is one trial, so short drafts also teach what long ones would do),
c_acc the continuation rate after an accepted token (a confident draft is more often right), and
draft_cost(l) the draft's time to propose l tokens (it first catches up on the tokens accepted since
its last step, in one batch, then decodes one token at a time) and verify_cost(n) the oracle's cost
of an n-token pass, all measured (at start-up by `calibrate`, then online). A long allowance is cheap
when the draft often stops early: the policy does not pay for tokens that are never drafted.
k = 0 is plain oracle decoding, and it also wins unless the best k is predicted to beat it by
`min_gain` (10%): a smaller predicted gain is within the error of the estimates and of a shared
machine's timings (the acceptance estimate lags the text), and drafting on it risks a loss for next
to nothing. When k = 0 wins, the policy still probes with a short draft now and then, so a
better-matched stretch of text is noticed. A probe after idle steps is dear (the
draft first catches up on the text it skipped), so probing is held to a small share of the time spent
(`probe_budget`): a badly matched draft costs next to nothing once the policy has stopped using it.
It stops only after judging `min_trials` draft tokens: an unlucky first step is not evidence enough.

The acceptance and continuation estimates are running means over trials that settle into an
exponential average (each trial weighs at least 1 - `decay`): quick to learn from a fresh start,
steady afterwards. A probe after a pause drafts from the start of the text and a short window of
recent text, not all of it (catching up would cost more than the probe is worth), so its acceptance
may read low. When the policy is idle on a close call (the best k predicted within `retry_ratio` of
plain decoding) a new request re-tries drafting with the draft on its whole prompt, for
`min_trials` draft tokens that count as fresh evidence: one hard prompt does not end drafting on a
pair that usually pays, and a pair that never pays is not re-tried.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import numpy as np


class LengthPolicy(Protocol):
    def draft_length(self, limit: int) -> int:
        """Tokens to draft in the next step, 0..limit (0: plain oracle step)."""

    def update(self, *, n_drafted: int, n_accepted: int, draft_time: float, verify_time: float) -> None:
        """The outcome of the step just verified."""

    def start_request(self) -> None:
        """A new request begins (before its prompt is evaluated)."""

    @property
    def idle(self) -> bool:
        """Whether the policy expects to draft nothing in the coming steps (a probe aside)."""


class FixedLength:
    """Always draft `k` tokens (fewer near max_tokens or the end of the context)."""

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError("draft length must be >= 0")
        self.k = k

    def draft_length(self, limit: int) -> int:
        return min(self.k, limit)

    @property
    def idle(self) -> bool:
        return self.k == 0

    def update(self, *, n_drafted: int, n_accepted: int, draft_time: float, verify_time: float) -> None:
        pass

    def start_request(self) -> None:
        pass


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through a handful of points (plain Python: quicker
    than numpy at this size); through the origin for a single point (the pessimistic guess)."""
    if len(xs) == 1:
        return 0.0, ys[0] / xs[0]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


class CostCurve:
    """Time as a function of a size (the oracle's n-token pass, the draft's k-token proposal): a
    running mean per size, and a least-squares line t = a + b*n through the sizes seen, for sizes
    not seen yet. Cheap to query: the policy asks for every k on every step."""

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self.mean: dict[int, float] = {}

    def observe(self, n: int, seconds: float) -> None:
        old = self.mean.get(n)
        self.mean[n] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def __call__(self, n: int) -> float:
        return float(self.many(np.array([n]))[0])

    def many(self, ns: np.ndarray) -> np.ndarray:
        """The cost of each size in `ns` [m]."""
        ns = np.asarray(ns, dtype=np.float64)
        if not self.mean:
            return ns.copy()  # no data: any monotone guess; calibrate() replaces it
        sizes, times = list(self.mean.keys()), list(self.mean.values())
        intercept, slope = fit_line(sizes, times)
        out = intercept + slope * ns if len(sizes) == 1 else np.maximum(intercept + slope * ns, min(times))
        # measured sizes: their own running mean
        return np.array([self.mean.get(n, fit) for n, fit in zip(ns.astype(int).tolist(), out.tolist())])


class AdaptiveLength:
    """Cost-aware draft length (see the module docstring)."""

    def __init__(self, *, k_max: int = 16, prior_acceptance: float = 0.9, prior_continuation: float = 1.0,
                 prior_weight: float = 4.0,
                 decay: float = 0.97, probe_every: int = 16, probe_budget: float = 0.01, probe_length: int = 2,
                 min_trials: int = 8, min_gain: float = 0.10, retry_ratio: float = 0.9) -> None:
        self.k_max = k_max
        self.acceptance = prior_acceptance  # a: per drafted token, given the previous ones were accepted
        self.continuation = prior_continuation  # c: the draft proposes one more token (allowance left)
        self.continuation_accepted = prior_continuation  # c_acc: the same, after a token that was accepted
        self._continuation_events = self._continuation_accepted_events = 0  # outcomes behind each
        self.prior_weight = prior_weight  # the prior (or, on a re-try, the old estimate) counts as this many trials
        self.decay = decay
        self.verify_cost = CostCurve()  # seconds for an oracle pass of n tokens
        self.draft_cost = CostCurve()  # seconds for the draft to propose k tokens
        self.probe_every = probe_every  # idle (k = 0) steps before a probe
        self.probe_budget = probe_budget  # most of the time spent that probes may take
        self.probe_length = probe_length
        self.min_trials = min_trials  # draft tokens judged before the policy may give up on drafting
        self.min_gain = min_gain  # predicted speedup over k = 0 below which drafting is not worth it
        self.retry_ratio = retry_ratio  # idle on a closer call than this: re-try at the next request
        self.trials = 0  # draft tokens judged, ever
        self.fresh_trials = 0  # since the start or the last re-try
        self.time_spent = 0.0  # seconds, every step
        self.probe_time = 0.0  # seconds that probes took beyond a plain oracle step
        self._idle = 0  # consecutive k = 0 steps
        self.recheck_every = 8  # while idle, judge k afresh every this many steps
        self._probing = False
        self.last_k = 0

    @property
    def calibrated(self) -> bool:
        return len(self.draft_cost.mean) >= 2 and len(self.verify_cost.mean) >= 2

    @property
    def idle(self) -> bool:
        return self.calibrated and self.fresh_trials >= self.min_trials and self.best_length(self.k_max) == 0

    def calibrate(self, time_verify: Callable[[int], float], time_draft: Callable[[int], float],
                  sizes: tuple[int, ...] = (1, 2, 4, 8, 16)) -> None:
        """Measure the oracle's pass at a few sizes, and the draft's batch of 2 (catching up on the
        last accepted token and the new one) and single-token decode."""
        for n in sizes:
            self.verify_cost.mean[n] = time_verify(n)
        catch_up, per_token = time_draft(2), time_draft(1)
        self.draft_cost.mean[1] = catch_up
        self.draft_cost.mean[self.k_max] = catch_up + (self.k_max - 1) * per_token

    def expected_tokens(self, k: int) -> float:
        return float(self._expected_tokens(k)[k])

    def step_time(self, k: int) -> float:
        return float(self._step_times(k)[k])

    def _expected_tokens(self, k_top: int) -> np.ndarray:
        """E(k) for k = 0..k_top [k_top+1]."""
        i = np.arange(1, k_top + 1)  # [K] draft positions
        reached = self.acceptance ** i * self.continuation_accepted ** (i - 1)  # [K] P(1..i proposed and accepted)
        return 1.0 + np.concatenate(([0.0], np.cumsum(reached)))

    def _step_times(self, k_top: int) -> np.ndarray:
        """T(k) for k = 0..k_top [k_top+1]."""
        lengths = np.arange(1, k_top + 1)  # [K] tokens drafted
        verify = self.verify_cost.many(np.arange(1, k_top + 2))  # [K+1] passes of 1..K+1 tokens
        cost = self.draft_cost.many(lengths) + verify[1:]  # [K]
        c = self.continuation
        at_least = c ** (lengths - 1)  # [K] P(L >= l)
        stopped = np.concatenate(([0.0], np.cumsum(at_least * (1.0 - c) * cost)))[:-1]  # [K] drafts ending before l
        return np.concatenate((verify[:1], stopped + at_least * cost))

    def _rates(self, limit: int) -> np.ndarray:
        k_top = min(limit, self.k_max)
        return self._expected_tokens(k_top) / self._step_times(k_top)  # [K+1] tokens per second

    def best_length(self, limit: int) -> int:
        rate = self._rates(limit)  # [K+1]
        k = int(np.argmax(rate))  # the shortest k on a tie
        return k if rate[k] >= (1.0 + self.min_gain) * rate[0] else 0

    def start_request(self) -> None:
        if not self.idle:
            return
        rate = self._rates(self.k_max)  # [K+1]
        if rate[1:].max(initial=0.0) >= self.retry_ratio * rate[0]:
            self.fresh_trials = 0  # a close call: judge min_trials draft tokens on this prompt

    def draft_length(self, limit: int) -> int:
        self._probing = False
        if limit <= 0:
            return 0
        if self._idle % self.recheck_every and self.fresh_trials >= self.min_trials:
            k = 0  # idle: only the oracle's cost moved since the last judgement (~0.1 ms saved per step)
        else:
            k = self.best_length(limit)
        if k == 0 and self.fresh_trials < self.min_trials:
            k = min(self.probe_length, limit)  # one or two early rejections are not evidence enough
        elif k == 0:
            self._idle += 1
            if self._idle >= self.probe_every and self.probe_time <= self.probe_budget * self.time_spent:
                self._idle = 0
                self._probing = True
                k = min(self.probe_length, limit)
        else:
            self._idle = 0
        self.last_k = k
        return k

    def update(self, *, n_drafted: int, n_accepted: int, draft_time: float, verify_time: float) -> None:
        trials = n_accepted + (n_accepted < n_drafted)  # the accepted tokens and the first rejected one
        for i in range(trials):
            self.trials += 1
            self.fresh_trials += 1
            self.acceptance = self._blend(self.acceptance, i < n_accepted, self.fresh_trials)
        if n_drafted:
            self._observe_continuation(n_drafted, n_accepted, allowance=max(self.last_k, n_drafted))
        self.time_spent += draft_time + verify_time
        if self._probing:
            self.probe_time += max(0.0, draft_time + verify_time - self.verify_cost(1))
        self.verify_cost.observe(n_drafted + 1, verify_time)
        # a probe after idle steps pays for the draft catching up on all of them: not a fair sample
        if n_drafted and not self._probing:
            self.draft_cost.observe(n_drafted, draft_time)

    def _observe_continuation(self, n_drafted: int, n_accepted: int, *, allowance: int) -> None:
        """After each drafted token the draft went on (it is not the last) or stopped (the last, short
        of the allowance); the last token of a draft that used its whole allowance tells nothing."""
        for i in range(1, n_drafted + 1):
            went_on = i < n_drafted
            if not went_on and n_drafted == allowance:
                break
            self._continuation_events += 1
            self.continuation = self._blend(self.continuation, went_on, self._continuation_events)
            if i <= n_accepted:
                self._continuation_accepted_events += 1
                self.continuation_accepted = self._blend(self.continuation_accepted, went_on,
                                                         self._continuation_accepted_events)

    def _blend(self, estimate: float, outcome: bool, n: int) -> float:
        """A running mean over the n outcomes so far (the prior counting as prior_weight of them)
        that settles into an exponential average: each outcome weighs at least 1 - decay."""
        weight = max(1.0 - self.decay, 1.0 / (self.prior_weight + n))
        return estimate + weight * (outcome - estimate)
