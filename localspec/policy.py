"""Draft-length policies: how many tokens to draft in the next step.

The engine asks `draft_length(limit)` before each step and reports the outcome with `update(...)`,
so a policy can hide any schedule (fixed, cost-aware) behind two calls.

`AdaptiveLength` (the default) picks the k that maximises expected tokens per second:

    expected tokens per step   E(k) = 1 + a + a^2 + ... + a^k
    time per step              T(k) = draft_cost(k) + verify_cost(k + 1)        (draft_cost(0) = 0)

where a is the running acceptance rate of a draft token given the ones before it were accepted
(each drafted token up to the first rejection is one trial, so short drafts also teach what long
ones would do), draft_cost(k) the draft's time to propose k tokens (it first catches up on the
tokens accepted since its last step, in one batch, then decodes one token at a time) and
verify_cost(n) the oracle's cost of an n-token pass, all measured (at start-up by `calibrate`, then
online). k = 0 is plain oracle decoding; when
that wins, the policy still probes with a short draft now and then, so a better-matched stretch of
text is noticed.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np


class LengthPolicy(Protocol):
    def draft_length(self, limit: int) -> int:
        """Tokens to draft in the next step, 0..limit (0: plain oracle step)."""

    def update(self, *, n_drafted: int, n_accepted: int, draft_time: float, verify_time: float) -> None:
        """The outcome of the step just verified."""


class FixedLength:
    """Always draft `k` tokens (fewer near max_tokens or the end of the context)."""

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError("draft length must be >= 0")
        self.k = k

    def draft_length(self, limit: int) -> int:
        return min(self.k, limit)

    def update(self, *, n_drafted: int, n_accepted: int, draft_time: float, verify_time: float) -> None:
        pass


class CostCurve:
    """Time as a function of a size (the oracle's n-token pass, the draft's k-token proposal): a
    running mean per size, and a least-squares line t = a + b*n through the sizes seen, for sizes
    not seen yet."""

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self.mean: dict[int, float] = {}

    def observe(self, n: int, seconds: float) -> None:
        old = self.mean.get(n)
        self.mean[n] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def __call__(self, n: int) -> float:
        if n in self.mean:
            return self.mean[n]
        if not self.mean:
            return float(n)  # no data: any monotone guess; calibrate() replaces it
        sizes = np.array(sorted(self.mean), dtype=np.float64)
        times = np.array([self.mean[int(s)] for s in sizes])
        if len(sizes) == 1:
            return float(times[0] * n / sizes[0])  # proportional: the pessimistic guess
        b, a = np.polyfit(sizes, times, 1)
        return float(max(a + b * n, times.min()))


class AdaptiveLength:
    """Cost-aware draft length (see the module docstring)."""

    def __init__(self, *, k_max: int = 16, prior_acceptance: float = 0.9, decay: float = 0.9,
                 probe_every: int = 16, max_probe_every: int = 128, probe_length: int = 2) -> None:
        self.k_max = k_max
        self.acceptance = prior_acceptance  # a: per drafted token, given the previous ones were accepted
        self.decay = decay
        self.verify_cost = CostCurve()  # seconds for an oracle pass of n tokens
        self.draft_cost = CostCurve()  # seconds for the draft to propose k tokens
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self._probe_interval = probe_every
        self.probe_length = probe_length
        self._idle = 0  # consecutive k = 0 steps
        self._probing = False
        self.last_k = 0

    @property
    def calibrated(self) -> bool:
        return len(self.draft_cost.mean) >= 2 and len(self.verify_cost.mean) >= 2

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
        a = self.acceptance
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

    def step_time(self, k: int) -> float:
        return (self.draft_cost(k) if k else 0.0) + self.verify_cost(k + 1)

    def best_length(self, limit: int) -> int:
        ks = range(0, min(limit, self.k_max) + 1)
        return max(ks, key=lambda k: self.expected_tokens(k) / self.step_time(k))

    def draft_length(self, limit: int) -> int:
        self._probing = False
        if limit <= 0:
            return 0
        k = self.best_length(limit)
        if k == 0:
            self._idle += 1
            if self._idle >= self._probe_interval:
                # probe; if plain decoding still wins afterwards, wait twice as long for the next one
                self._idle = 0
                self._probing = True
                self._probe_interval = min(2 * self._probe_interval, self.max_probe_every)
                k = min(self.probe_length, limit)
        else:
            self._idle = 0
            self._probe_interval = self.probe_every
        self.last_k = k
        return k

    def update(self, *, n_drafted: int, n_accepted: int, draft_time: float, verify_time: float) -> None:
        d = self.decay
        trials = n_accepted + (n_accepted < n_drafted)  # the accepted tokens and the first rejected one
        weight = d ** trials  # an EMA over trials: each trial moves a by (1 - d)
        self.acceptance = weight * self.acceptance + (1 - weight) * (n_accepted / trials if trials else 0.0)
        self.verify_cost.observe(n_drafted + 1, verify_time)
        # a probe after idle steps pays for the draft catching up on all of them: not a fair sample
        if n_drafted and not self._probing:
            self.draft_cost.observe(n_drafted, draft_time)
