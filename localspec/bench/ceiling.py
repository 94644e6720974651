"""The ceiling: the speedup speculative decoding should give, from acceptance and measured costs.

Standard model (Leviathan et al. 2023; Chen et al. 2023): each draft token is accepted with
probability a, independently, given the ones before it were. A step drafts K tokens and verifies
them in one oracle pass over K+1 positions; it yields the accepted prefix plus one oracle token:

    E(a, K)         = 1 + a + a^2 + ... + a^K = (1 - a^(K+1)) / (1 - a)     tokens per step
    step time       = K * c_draft + c_verify(K + 1)
    predicted speed = E * c_verify(1) / step time                            (the oracle alone: 1 token per c_verify(1))

`c_draft` is the draft's cost per token and `c_verify(n)` the oracle's cost of an n-token pass.

For localspec's systems the prediction goes step by step, from the engine's own per-step records:
`fit_costs` fits the context-aware pass-cost model (localspec.speculative.costs: verify(n, c), draft(l, c)) to
every step a system ran, and `record_ceiling` predicts, for the steps a run actually took (their
draft lengths, accepted tokens and context lengths), the oracle alone's time for the same tokens
over the speculative time:

    predicted speedup = sum_steps (accepted + 1) * verify(1, c) / sum_steps (draft(l, c) + verify(l + 1, c))

The one-token cost verify(1, c) of the numerator is fitted to the baseline's steps (the oracle alone,
every pass one token) where the run has them: a system at fixed K runs passes of one size (its
requests' first steps aside), so its own fit extrapolates to one token and read 20-40% low (ceilings
below the measured speedup, "efficiencies" of 110-175%).

Measured speedup / predicted speedup is the efficiency: how much of the possible gain the
implementation keeps (Python overhead, sampling, cache bookkeeping, ...). No model needed.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

from localspec.speculative.costs import PassCost, expected_tokens, fit_steps
from localspec.speculative.costs import predicted_speedup as predicted_steps_speedup
from localspec.outputs import StepRecord
from localspec.speculative.policy import fit_line


def acceptance_from_tokens_per_step(tokens_per_step: float, k: float) -> float:
    """The per-token acceptance a for which E(a, k) equals a measured tokens-per-step (bisection)."""
    if k <= 0 or tokens_per_step <= 1.0:
        return 0.0
    if tokens_per_step >= k + 1.0:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens(mid, k) < tokens_per_step:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def step_time(k: float, c_draft: float, c_verify: Callable[[float], float]) -> float:
    """Time of one step drafting k tokens: k * c_draft + c_verify(k + 1)."""
    return k * c_draft + c_verify(k + 1.0)


def predicted_speedup(a: float, k: float, c_draft: float, c_verify: Callable[[float], float]) -> float:
    """E(a, k) * c_verify(1) / (k * c_draft + c_verify(k + 1))."""
    t = step_time(k, c_draft, c_verify)
    if t <= 0:
        raise ValueError("the step time must be positive")
    return expected_tokens(a, k) * c_verify(1.0) / t


def predicted_speedup_per_step(tokens_per_step: float, draft_lengths: Mapping[int, int], c_draft: float,
                               c_verify: Callable[[float], float]) -> float:
    """The same prediction when the draft length varies from step to step (adaptive length, prompt
    lookup): the step time is averaged over the measured draft lengths {k: steps}, and E is the
    measured tokens per step. With one k it equals predicted_speedup(a, k, ...) for the a whose
    E(a, k) is tokens_per_step."""
    steps = sum(draft_lengths.values())
    if steps <= 0:
        raise ValueError("no steps")
    t = sum(n * step_time(k, c_draft, c_verify) for k, n in draft_lengths.items()) / steps
    if t <= 0:
        raise ValueError("the step time must be positive")
    return tokens_per_step * c_verify(1.0) / t


def cost_curve(points: Mapping[int | float, float]) -> Callable[[float], float]:
    """c_verify(n) from measured {n: seconds}: the measurement itself at a measured n, linear
    interpolation between measured sizes, a least-squares line beyond them."""
    if not points:
        raise ValueError("no cost measurements")
    xs = sorted(float(n) for n in points)
    ys = [float(points[n if n in points else int(n)]) for n in xs]
    by_n = dict(zip(xs, ys))

    intercept, slope = fit_line(xs, ys)

    def c(n: float) -> float:
        n = float(n)
        if n in by_n:
            return by_n[n]
        if xs[0] < n < xs[-1]:
            for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
                if x0 <= n <= x1:
                    return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        return max(intercept + slope * n, min(ys))

    return c


def steps_of(records: Sequence[Sequence[float]]) -> list[StepRecord]:
    """The bench worker's compact records ([k, drafted, accepted, draft_time, verify_time, context,
    draft_evaluated, draft_prompt_time, source]; reports written before the last fields have 7 or
    8: a drafted step's source was then its system's, a draft model or prompt lookup with no
    evaluated token) as the engine's StepRecords."""
    def source(r) -> str:
        if len(r) > 8:
            return str(r[8])
        return "" if not int(r[1]) else ("model" if int(r[6]) else "lookup")

    return [StepRecord(int(r[0]), int(r[1]), int(r[2]), float(r[3]), float(r[4]), int(r[5]), int(r[6]),
                       float(r[7]) if len(r) > 7 else 0.0, source(r))
            for r in records]


def fit_costs(records: Sequence[Sequence[float]]) -> tuple[PassCost, PassCost] | None:
    """localspec.speculative.costs.fit_steps over compact records."""
    return fit_steps(steps_of(records))


def record_ceiling(records: Sequence[Sequence[float]], verify: PassCost, draft: PassCost | None,
                   alone: PassCost | None = None) -> float | None:
    """The speedup predicted for the steps in `records` (see the module docstring). `draft` None:
    proposing costs nothing (prompt lookup). `alone`: the one-token cost fitted to the oracle
    alone's run (the baseline's steps), else `verify`'s."""
    return predicted_steps_speedup(steps_of(records), verify, draft, alone)


def median(values: Sequence[float]) -> float:
    v = sorted(values)
    if not v:
        return math.nan
    m = len(v) // 2
    return v[m] if len(v) % 2 else (v[m - 1] + v[m]) / 2


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    v = sorted(values)
    if not v:
        return math.nan
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def geomean(values: Sequence[float]) -> float:
    v = [x for x in values if x > 0]
    if not v:
        return math.nan
    return math.exp(sum(math.log(x) for x in v) / len(v))


# two-sided 95% quantiles of Student's t by degrees of freedom (the nearest lower one is used)
_T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 12: 2.18,
         15: 2.13, 20: 2.09, 25: 2.06, 30: 2.04, 40: 2.02, 60: 2.00, 120: 1.98}


def ratio_interval(ratios: Sequence[float]) -> tuple[float, float] | None:
    """A 95% confidence interval for the geometric mean of ratios (a t-interval on their logs), or
    None for fewer than 3 positive ratios."""
    logs = [math.log(x) for x in ratios if x > 0]
    n = len(logs)
    if n < 3:
        return None
    mean = sum(logs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    t = _T975[max(df for df in _T975 if df <= n - 1)] if n - 1 <= 120 else 1.96
    half = t * sd / math.sqrt(n)
    return math.exp(mean - half), math.exp(mean + half)
