"""What a pass costs: time as a function of the tokens in it and of the context it runs at, learned
from every speculative step and kept between processes.

A llama.cpp pass of n tokens over a context of c tokens costs about

    t(n, c) = w0 + w1*[n > 1] + w2*n + (w3 + w4*n) * c/1024

    w0, w2   the weights are read once per pass, and each token adds its compute (a CPU is
             compute-bound past a few tokens; a GPU hardly notices them)
    w1       one token takes the matrix-vector kernels, two or more the matrix-matrix ones
    w3, w4   attention reads the context, once per pass and for every token in it (flash
             attention on a CPU makes w4 large)

A pass that carries several sequences (n_s tokens of sequence s, over its context c_s) costs

    t = w0 + w1*[N > 1] + w2*N + (w3*sum_s c_s + w4*sum_s n_s*c_s)/1024 + w5*(S - 1)

with N = sum_s n_s tokens and S sequences: the weights are still read once (llama.cpp's batched
decoding of 1 / 2 / 4 / 8 / 16 sequences of the default F32 oracle reads 49 / 72 / 107 / 161 / 212
tokens/s on a 2-core EPYC: a pass costs about w0 + w2*N whoever its tokens are for), each sequence
attends to its own cache, and w5 is what another sequence adds beside its tokens. One sequence is
the form above.

The same form serves the draft, with n the tokens it drafts in a step (its catch-up on the tokens
accepted since its last step, one or two, sits in w0).

`PassCost` fits w by exponentially weighted least squares (recent steps count most, so it follows a
machine whose speed drifts), pulled toward a prior whose shape is a typical CPU's and whose scale is
set by the first measurement. The context terms are held firmly to their prior until passes over
contexts of many lengths show otherwise: within one request the context grows as time passes, so a
machine that slows down for a minute would otherwise read as attention that grows with the
context. They are also held at or above zero (attention never makes a pass cheaper), so a fit
made at short contexts never predicts a long context's passes cheaper than a short one's. Nothing
is timed on purpose: every step is a measurement.

What a policy learned is kept between processes by `localspec.runtime.learning` (the store, keyed
by everything that changes the costs): this module is the pure fit and its algebra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    from localspec.outputs import StepRecord

N_FEATURES = 6
CONTEXT_UNIT = 1024.0  # context lengths enter the fit in units of 1024 tokens
# relative prior shapes (times in units of a one-token pass at no context): an oracle pass of n
# tokens costs 1 + 0.2 [n > 1] + 0.1 (n - 1) one-token passes, 0.15 + 0.02 n more per 1024 tokens of
# context (an F32 oracle on a 2-core AVX512 CPU without flash attention; a GPU learns its flatter
# curve in a few steps); a draft proposal that evaluates n tokens (its catch-up, then one decode per
# drafted token but the last) costs n of its one-token decodes and a little per call, and, a small
# model's weights being cheap, relatively more for its attention
VERIFY_SHAPE = (0.9, 0.2, 0.1, 0.15, 0.02, 0.05)
DRAFT_SHAPE = (0.2, 0.0, 1.0, 0.2, 0.3, 0.05)
# a draft model's decode of a token for each of several sequences (a round of batched drafting), or
# of a catch-up: between a pass that reads its weights once for every token (a GPU) and one that
# pays for each token (a small quantized model on a CPU: the default Q4_1 draft costs ~8 ms a token
# in a batch, ~10 ms alone)
DRAFT_ROUND_SHAPE = (0.6, 0.1, 0.4, 0.15, 0.05, 0.05)
# how far each weight may plausibly sit from the prior, in the same units, and the noise of one
# measured step (a shared VM's steps vary by 10-20%): together they say how much evidence moves it
PRIOR_SPREAD = (1.0, 0.5, 0.5, 0.1, 0.03, 0.2)
NOISE = 0.15
START = 3  # passes whose median sets the prior's scale


def features(ns: np.ndarray, context: float) -> np.ndarray:
    """phi(n, c) [m, 6] for one sequence's pass sizes ns [m] at one context length."""
    ns = np.asarray(ns, dtype=np.float64)
    c = context / CONTEXT_UNIT
    return np.stack([np.ones_like(ns), (ns > 1).astype(np.float64), ns, np.full_like(ns, c), ns * c,
                     np.zeros_like(ns)], axis=1)


def pass_features(ns: Sequence[int], contexts: Sequence[int]) -> np.ndarray:
    """phi [6] of one pass carrying n_s tokens of each sequence s over its context c_s."""
    return passes_features([(ns, contexts)])


def passes_features(passes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> np.ndarray:
    """phi [6] of one decode llama.cpp runs as `passes` (each (ns, contexts)): the passes' features
    add up (summed in plain Python: a step may price several decodes)."""
    return np.array(_features(passes))


def _features(passes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[float]:
    """`passes_features` as a list."""
    if len(passes) == 1 and len(passes[0][0]) == 1:  # one sequence's pass (most steps): no loops
        (n,), (c,) = passes[0]
        return [1.0, float(n > 1), float(n), c / CONTEXT_UNIT, n * c / CONTEXT_UNIT, 0.0]
    phi = [0.0] * N_FEATURES
    for ns, contexts in passes:
        total = sum(ns)
        phi[0] += 1.0
        phi[1] += total > 1
        phi[2] += total
        phi[3] += sum(contexts) / CONTEXT_UNIT
        phi[4] += sum(n * c for n, c in zip(ns, contexts)) / CONTEXT_UNIT
        phi[5] += len(ns) - 1
    return phi


class PassCost:
    """t(n, c) in seconds, fitted online (see the module docstring).

    `decay`: each new observation multiplies the weight of the older ones by this (0.99: the last
    ~100 steps count). `spread` [6] / `noise`: the prior's uncertainty per weight and a step's, both
    relative to the one-token time. Observations more than `outlier` times the prediction are
    clipped to it (a stall, from the VM or another program, must not teach a new cost); quicker ones
    are not (nothing makes a pass quicker than it is, and a fit that started on a stall must be able
    to come down: with a two-sided clip, a first draft proposal caught in a 300 ms stall held the
    draft's cost at 264 ms a token and the policy idle for a whole bench run).
    """

    def __init__(self, shape: Sequence[float] = VERIFY_SHAPE, *, decay: float = 0.99,
                 spread: Sequence[float] = PRIOR_SPREAD, noise: float = NOISE, outlier: float = 2.0) -> None:
        self.shape = np.asarray(shape, dtype=np.float64)  # [6]
        self._floor_shape = 0.1 * float(self.shape[0] + self.shape[2])  # the floor, per unit of scale
        self.decay = decay
        self.ridge = np.diag((noise / np.asarray(spread, dtype=np.float64)) ** 2)  # [6, 6]
        self.outlier = outlier
        self.scale: float | None = None  # seconds per unit of the shape: set by the first observation
        self.gram = np.zeros((N_FEATURES, N_FEATURES))  # [6, 6] sum of decayed phi phi^T
        self.moment = np.zeros(N_FEATURES)  # [6] sum of decayed phi * t
        self.weight = 0.0  # sum of decayed observation weights
        # observations not yet in gram/moment/weight (`_fold` adds them, in one go, when a fit or the
        # sums are wanted: a 6x6 update costs ~16 us in numpy, and an idle step observes one pass)
        self._pending: list[tuple[np.ndarray, float]] = []
        self.observations = 0  # ever, including those loaded
        self._w: np.ndarray | None = None  # the fit, None when observations came since
        self._listed: tuple[np.ndarray, list[float]] | None = None  # a fit and its Python floats
        self._last: np.ndarray | None = None  # the latest fit made (for clipping outliers)
        self._start: list[tuple[np.ndarray, float]] = []  # the first START passes, until they set the scale

    @property
    def ready(self) -> bool:
        """Whether it can predict (it has seen a pass, here or in an earlier process)."""
        return self.scale is not None

    def observe(self, n: int, context: int, seconds: float) -> None:
        """A pass of n tokens of one sequence over `context` tokens took `seconds`."""
        self.observe_pass((n,), (context,), seconds)

    def observe_pass(self, ns: Sequence[int], contexts: Sequence[int], seconds: float) -> None:
        """A pass carrying ns[s] tokens of each sequence s over its context contexts[s] took `seconds`."""
        self.observe_passes([(ns, contexts)], seconds)

    def observe_passes(self, passes: Sequence[tuple[Sequence[int], Sequence[int]]], seconds: float) -> None:
        """One decode that llama.cpp ran as several passes (its ubatches: each (tokens per sequence,
        their contexts)) took `seconds` in all: the model is linear, so their features add up."""
        if not passes or not seconds > 0:
            return
        for ns, _ in passes:
            if not ns or min(ns) < 1:
                return
        phi = _features(passes)  # [6]
        if self.observations < START:
            self._start.append((np.array(phi), seconds))
            self.observations += 1
            self._w = None
            if self.observations == START:
                self._settle_start()
            else:  # until then, the lowest guess (a stall only ever slows a pass down)
                self.scale = min(t / float(f @ self.shape) for f, t in self._start)
            return
        if self.observations >= START + 2:
            # against the last fit (a few steps stale at most): no solve on every step
            expected = self._at(self._last if self._last is not None else self.weights(), phi)
            seconds = min(seconds, expected * self.outlier)  # a stall only ever slows a pass down
        self._add(phi, seconds)
        self.observations += 1
        self._w = None

    def _settle_start(self) -> None:
        """The prior's scale from the median of the first START passes (one of them caught in a
        stall must not set it), and those passes into the fit, each clipped to `outlier` times
        what that scale predicts for it."""
        scales = sorted(t / float(f @ self.shape) for f, t in self._start)
        self.scale = scales[(len(scales) - 1) // 2]  # the lower median
        for phi, seconds in self._start:
            self._add(phi, min(seconds, self.outlier * self.scale * float(phi @ self.shape)))
        self._start = []

    def _add(self, phi: np.ndarray | list[float], seconds: float) -> None:
        self._pending.append((phi, seconds))
        if len(self._pending) >= 64:  # a cost that is never asked for stays small all the same
            self._fold()

    def _fold(self) -> None:
        """The pending observations into the decayed sums, the latest weighing most: the same sums as
        adding each in turn (gram <- decay * gram + phi phi^T, ...), up to rounding."""
        if not self._pending:
            return
        phis = np.array([phi for phi, _ in self._pending])  # [m, 6]
        seconds = np.array([t for _, t in self._pending])  # [m]
        m = len(self._pending)
        self._pending = []
        w = self.decay ** np.arange(m - 1, -1, -1)  # [m] the weight each has once the last is in
        scale = self.decay ** m
        self.gram = scale * self.gram + (phis * w[:, None]).T @ phis
        self.moment = scale * self.moment + phis.T @ (w * seconds)
        self.weight = scale * self.weight + float(w.sum())

    def weights(self) -> np.ndarray:
        """w [6]: the ridge (maximum a posteriori) solution of
        min sum_i d_i (phi_i w - t_i)^2 + sum_j r_j (w_j - w_prior_j)^2, d_i the decayed weight of
        observation i and r_j = (noise / spread_j)^2: with no data it is the prior, and a weight
        that the data cannot tell apart (all passes of one size, say) stays near the prior's."""
        if self._w is None:
            assert self.scale is not None
            self._fold()
            prior = self.scale * self.shape  # [6]
            self._w = self._last = _solve_context_nonnegative(self.gram + self.ridge, self.moment + self.ridge @ prior)
        return self._w

    def _weights_list(self) -> list[float]:
        """`weights()` as Python floats (the fit's last conversion kept): numpy's scalar
        arithmetic costs ~10x theirs, and a policy prices a few lengths a step."""
        return self._floats(self.weights())

    def _floats(self, w: np.ndarray) -> list[float]:
        """A fit `w` [6] as Python floats, the last conversion kept (an idle step asks of one fit
        twice: its clip, its price)."""
        if self._listed is None or self._listed[0] is not w:
            self._listed = (w, w.tolist())
        return self._listed[1]

    def _floor(self) -> float:
        assert self.scale is not None
        return self.scale * self._floor_shape

    def _scalar(self, w: list[float], n: int, c: float) -> float:
        t = w[0] + w[3] * c + (max(0.0, w[1]) if n > 1 else 0.0) + max(0.0, w[2] + w[4] * c) * n
        return max(t, self._floor())

    def _at(self, w: np.ndarray, phi: np.ndarray | list[float]) -> float:
        """The prediction for features phi [6] (of one pass, or the sum over several), held like
        `predict`'s: no part of it below zero (a token, a sequence or a context never makes a pass
        cheaper). In Python floats: numpy's scalar arithmetic costs ~10x theirs (a step asks once)."""
        w, phi = self._floats(w), phi if isinstance(phi, list) else phi.tolist()
        per_token = max(0.0, w[2] + w[4] * phi[4] / phi[2]) if phi[2] else 0.0
        t = (w[0] * phi[0] + w[3] * phi[3] + max(0.0, w[1]) * phi[1] + per_token * phi[2]
             + max(0.0, w[5]) * phi[5])
        return max(t, self._floor() * phi[0])

    def pass_time(self, ns: Sequence[int], contexts: Sequence[int]) -> float:
        """Seconds for a pass carrying ns[s] tokens of each sequence s over its context contexts[s]."""
        if self.scale is None:
            raise ValueError("no cost observed yet")
        return self._at(self.weights(), pass_features(ns, contexts))

    def decode_time(self, passes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> float:
        """Seconds for one decode that llama.cpp runs as `passes` (its ubatches: each (tokens per
        sequence, their contexts)), as `observe_passes` learns them."""
        if self.scale is None:
            raise ValueError("no cost observed yet")
        return self._at(self.weights(), passes_features(passes))

    def pass_overhead(self, context: int) -> float:
        """Seconds a pass of two or more tokens costs beyond its tokens (its weights read once): what
        another pass, a ubatch llama.cpp splits off a batch, adds."""
        w = self.weights()
        return max(0.0, float(w[0] + w[3] * context / CONTEXT_UNIT + max(0.0, w[1])))

    def token_time(self, context: int) -> float:
        """Seconds one more token over `context` adds to a pass of two or more tokens."""
        w = self.weights()
        return max(0.0, w[2] + w[4] * context / CONTEXT_UNIT)

    def sequence_time(self) -> float:
        """Seconds one more sequence adds to a pass, beside its tokens and its context."""
        return max(0.0, float(self.weights()[5]))

    def predict(self, ns: np.ndarray, context: int) -> np.ndarray:
        """Seconds for passes of each size in ns [m] at `context`: never decreasing in n, never
        below a tenth of the prior's one-token time."""
        return np.array(self.times(np.asarray(ns, dtype=np.float64).tolist(), context))

    def times(self, ns: Sequence[float], context: int) -> list[float]:
        """`predict` in Python floats, for the few sizes a policy prices each step (numpy's
        per-call cost on arrays of 17 is most of theirs)."""
        if self.scale is None:
            raise ValueError("no cost observed yet")
        w0, w1, w2, w3, w4, _ = self._weights_list()
        c = context / CONTEXT_UNIT
        base = w0 + w3 * c  # a one-token pass, without its per-token part
        more = max(0.0, w1)  # two tokens or more: the matrix-matrix kernels
        per_token = max(0.0, w2 + w4 * c)
        floor = self._floor()
        return [max(base + (more if n > 1 else 0.0) + per_token * n, floor) for n in ns]

    def __call__(self, n: int, context: int) -> float:
        if self.scale is None:
            raise ValueError("no cost observed yet")
        return self._scalar(self._weights_list(), n, context / CONTEXT_UNIT)

    # -- persistence

    def state(self, *, max_weight: float = 64.0) -> dict[str, Any]:
        """What another process needs to go on from here; the history counts as at most
        `max_weight` observations there, so its own steps soon outweigh it."""
        if self._start:
            self._settle_start()
        self._fold()
        shrink = self._shrink(max_weight)
        return {"shape": self.shape.tolist(), "scale": self.scale, "gram": (self.gram * shrink).tolist(),
                "moment": (self.moment * shrink).tolist(), "weight": self.weight * shrink,
                "observations": self.observations}

    def _shrink(self, max_weight: float) -> float:
        return min(1.0, max_weight / self.weight) if self.weight > 0 else 1.0

    def soften(self, max_weight: float) -> None:
        """Let the history count as at most `max_weight` observations from now on, so the next few
        outweigh it (the fit keeps its shape meanwhile): for a re-judgement on fresh evidence."""
        self._fold()
        shrink = self._shrink(max_weight)
        self.gram *= shrink
        self.moment *= shrink
        self.weight *= shrink
        self._w = None

    def restart(self) -> None:
        """Forget every observation: the next START set the prior's scale anew, as a fresh fit's
        first passes do (it predicts at the old scale until the first of them). Softening alone
        (`soften(0.0)`) kept the old scale in the prior, and two proposals of one size cannot tell
        a decode's cost from a token's: after a stall had set that scale at 7x a draft token, a
        re-try's first two drafts (7 and 10 tokens) fitted 230 ms a decode and 0 a token, and the
        re-try judged a paying draft idle."""
        self._fold()
        self.gram[:] = 0.0
        self.moment[:] = 0.0
        self.weight = 0.0
        self.observations = 0
        self._start = []
        self._w = self._last = None

    def load(self, state: Mapping[str, Any]) -> None:
        gram = np.asarray(state["gram"], dtype=np.float64)
        moment = np.asarray(state["moment"], dtype=np.float64)
        if gram.shape != (N_FEATURES, N_FEATURES) or moment.shape != (N_FEATURES,) or not (
                np.all(np.isfinite(gram)) and np.all(np.isfinite(moment))):
            raise ValueError("malformed cost state")
        scale = state.get("scale")
        self.scale = float(scale) if scale is not None and float(scale) > 0 else None
        self.gram, self.moment = gram, moment
        self.weight = float(state.get("weight", 0.0))
        self.observations = int(state.get("observations", 0))
        if self.scale is not None:  # its first passes are in the fit already
            self.observations = max(self.observations, START)
        self._start, self._pending = [], []
        self._w = self._last = None


def _solve_context_nonnegative(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """w [6] minimising the ridge objective whose normal equations are a w = b ([6, 6], [6]), with the
    context weights (w3, w4) held at or above zero: attention never makes a pass cheaper. Unheld,
    steps that all ran at short contexts (where the n*c feature is nearly a multiple of n) fitted
    w4 < 0 on the default pair: a 17-token pass predicted at 53 ms at 2048 tokens of context
    against 69 ms at 256, where it measures more. The constraint binds on one weight or both; the
    exact solution is the best of the few cases (the objective is convex)."""
    w = np.linalg.solve(a, b)
    if w[3] >= 0.0 and w[4] >= 0.0:
        return w
    best, best_value = None, np.inf
    for held in ((3,), (4,), (3, 4)):
        free = [j for j in range(N_FEATURES) if j not in held]
        v = np.zeros(N_FEATURES)
        v[free] = np.linalg.solve(a[np.ix_(free, free)], b[free])
        if v[3] < 0.0 or v[4] < 0.0:
            continue
        value = 0.5 * v @ a @ v - b @ v  # the objective, up to a constant
        if value < best_value:
            best, best_value = v, value
    assert best is not None  # holding both at zero is always feasible
    return best


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through a handful of points (plain Python: quicker
    than numpy at this size); through the origin for a single point (the pessimistic guess)."""
    if len(xs) == 1:
        return 0.0, ys[0] / xs[0]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


# ------------------------------------------------------------------------------------ steps


def draft_size(step: "StepRecord") -> int:
    """The draft cost's size of a step: the tokens its draft model evaluated (1 for a proposer
    without a model, whose cost does not grow with what it proposes)."""
    return max(1, step.draft_evaluated)


# a proposal that evaluated more draft tokens than this began with a catch-up (a batch), not a step's few
MAX_STEP_DRAFT_SIZE = 64


def fit_steps(steps: Sequence["StepRecord"], *,
              max_draft_size: int = MAX_STEP_DRAFT_SIZE) -> tuple[PassCost, PassCost] | None:
    """verify(n, c) and draft(e, c) (e: tokens the draft evaluated) fitted to `steps` in one go (no
    forgetting); None without a one-token step to anchor the verify cost (every request's first step
    is one). The draft cost is the draft model's: prompt lookup's steps (free) are left out of it,
    and so is a draft's catch-up on a prompt (a step with `draft_prompt_time`, or more than
    `max_draft_size` tokens): a batch of hundreds of tokens runs at another rate than a step's few."""
    if not any(s.drafted == 0 for s in steps):
        return None
    verify, draft = PassCost(VERIFY_SHAPE, decay=1.0), PassCost(DRAFT_SHAPE, decay=1.0)
    for s in sorted(steps, key=lambda s: s.drafted):  # one-token passes first: they set the scale
        verify.observe(s.drafted + 1, s.context, s.verify_time)
        if s.drafted and s.source != "lookup" and not _prompt_catch_up(s, max_draft_size):
            draft.observe(draft_size(s), s.context, s.draft_time)
    return verify, draft


def _prompt_catch_up(step: "StepRecord", max_draft_size: int = MAX_STEP_DRAFT_SIZE) -> bool:
    """Whether the step's proposal began with the draft evaluating a prompt (a batch)."""
    return step.draft_prompt_time > 0 or step.draft_evaluated > max_draft_size


# ------------------------------------------------------------------------------------ speedup
#
# The algebra every estimate of speculation's worth shares (the length policy, `localspec check`,
# the bench's ceiling, the chat's /stats): tokens a step is expected to yield, and the oracle
# alone's time for the same tokens over the time spent.


def expected_tokens(a: float, k):
    """Tokens a step drafting k is expected to yield (the accepted draft tokens and the oracle's
    own) in the standard model, every draft token accepted with probability a given the ones before
    it were: E = 1 + sum_{i=1..k} a^i = (1 - a^(k+1)) / (1 - a). `k`: a number, fractional too (a
    mean draft length), or an array of them (then an array). `expected_tokens_by_place`: the same
    with an acceptance per place and a draft that may stop early."""
    if not 0.0 <= a <= 1.0:
        raise ValueError("the acceptance a must be in [0, 1]")
    ks = np.asarray(k, dtype=np.float64)
    if np.any(ks < 0):
        raise ValueError("the draft length k must be >= 0")
    d = 1.0 - a  # without the rounding of forming a near 1
    if d <= 0.0:
        series = ks  # every token accepted
    elif d >= 1.0:
        series = (ks > 0).astype(np.float64)  # a = 0: nothing accepted
    else:
        series = -np.expm1(ks * np.log1p(-d)) / d  # (1 - a^k) / (1 - a), accurate for a near 1
    e = 1.0 + a * series
    return float(e) if e.ndim == 0 else e


def expected_tokens_by_place(ahead: Sequence[float], continuation: float = 1.0) -> list[float]:
    """E(k) for k = 0..K [K+1], each draft token i (of K) accepted with probability ahead[i] given
    the ones before it were, and the draft going on after an accepted token with probability
    `continuation`: E(k) = 1 + sum_{i=1..k} ahead[0] * ... * ahead[i-1] * continuation^(i-1).
    In Python floats (a policy asks every step, for K <= 64)."""
    out, total, reach, going_on = [1.0], 1.0, 1.0, 1.0
    for a in ahead:
        reach *= float(a)  # P(token i proposed, it and all before it accepted)
        total += reach * going_on
        going_on *= continuation
        out.append(total)
    return out


def speedup(oracle_alone: float | None, *spent: float) -> float | None:
    """The oracle alone's time for some tokens over the time speculation spent on them (the sum of
    `spent`); None when either is unknown or nothing was spent."""
    total = sum(spent)
    if oracle_alone is None or total <= 0 or oracle_alone <= 0:
        return None
    return oracle_alone / total


def oracle_alone_time(steps: Sequence["StepRecord"], verify: PassCost) -> float:
    """What the oracle alone would take for the tokens `steps` produced: one one-token pass per
    token (accepted + a recovered or bonus one), each at its step's context."""
    return sum((s.accepted + 1) * verify(1, s.context) for s in steps)


def estimated_speedup(spent: Any, verify: PassCost | None = None) -> float | None:
    """What `localspec chat`'s /stats and the server's chat page show: the oracle alone's time for
    the tokens of `spent` (a reply's Stats, or the chat's session totals: step `records`,
    `draft_time`, `verify_time`) over the draft + verify time they took. `verify`: the oracle's
    one-token pass fitted elsewhere (the chat fits the session's steps); None: fitted to `spent`'s
    own steps (every reply's first step is a one-token pass). Nothing is timed on purpose; the
    oracle's prompt evaluation is left out on both sides (the draft's catch-up on it counts: only
    speculation pays it). None when no one-token step anchors the fit."""
    if verify is None:
        fit = fit_steps(spent.records)
        if fit is None:
            return None
        verify = fit[0]
    return speedup(oracle_alone_time(spent.records, verify), spent.draft_time, spent.verify_time)


def predicted_speedup(steps: Sequence["StepRecord"], verify: PassCost, draft: PassCost | None,
                      alone: PassCost | None = None) -> float | None:
    """The speedup the fitted costs predict for the steps taken: the oracle alone's time for their
    tokens over the passes they ran (draft(l, c) + verify(l + 1, c) each; `draft` None or not
    measured; a prompt-lookup step: proposing costs nothing). `alone`: the oracle's one-token cost
    fitted to plain decoding's own steps, where there are some (a run at fixed K has one pass size
    but its first step's, so its own fit cannot tell a one-token pass from its per-token cost);
    None: `verify`'s. A proposal that began with the draft's catch-up on a prompt counts as
    measured: the model describes a step's few tokens, not a batch."""
    def proposing(s: "StepRecord") -> float:
        if not s.drafted or s.source == "lookup" or draft is None or not draft.ready:
            return 0.0
        return s.draft_time if _prompt_catch_up(s) else draft(draft_size(s), s.context)

    spent = sum(verify(s.drafted + 1, s.context) + proposing(s) for s in steps)
    return speedup(oracle_alone_time(steps, alone or verify), spent)
