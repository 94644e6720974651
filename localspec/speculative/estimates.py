"""What a length policy learns of a source's drafts, and keeps between processes (`Learned`,
shared by every request's fork of the policy): each sampling regime's (`Regime`) acceptance and
continuation (`Estimates`, by place: `AcceptanceByPlace`) and the fitted pass costs
(`costs.PassCost`); and the price of a draft in a pass other sequences share (`BatchPrice`). The
choice made from them is `lengths.AdaptiveLength`'s; the reasoning and the figures: docs/policy.md.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from localspec.outputs import StepRecord
from localspec.speculative.costs import DRAFT_ROUND_SHAPE, DRAFT_SHAPE, VERIFY_SHAPE, PassCost
from localspec.speculative.sampling import SamplingParams


# prompt lookup's acceptance, kept apart by the length of the match a token extends: under 3, 3-5,
# 6-11, 12-23, 24-47 and 48 or more tokens; and what to expect of each before anything is measured
# (scripts/lookup_priors.py: the bench's 26 prompts of chat, code, copy, grounded and long text, the
# default oracle's greedy answers, every position a lookup matched)
LOOKUP_RUNS = (3, 6, 12, 24, 48)
LOOKUP_PRIORS = (0.52, 0.65, 0.89, 0.95, 0.96, 0.99)


class AcceptanceByPlace:
    """A draft token's acceptance (given the ones before it in its step were accepted), kept apart
    by where the token stands. Two layouts:

    - `runs=None` (a draft model): a step's first token after a step whose draft was wholly
      accepted ("aligned"), a step's first token after one that was not ("fresh"), and every later
      token: keys 0 = first fresh, 1 = first aligned, 2 = later.
    - `runs=(e_1, e_2, ...)` (prompt lookup): by the length r of the match the token would extend:
      the tokens before the step's source that agree with the text's last ones (`Draft.match_length`),
      plus the token's place in the step; key b for e_b <= r < e_(b+1) (key 0: r < e_1). A 2-token
      match is a poor bet and a copy that has held for 30 tokens a near-certain one (measured: see
      LOOKUP_PRIORS); one rate for every token after a step's first priced a fresh 2-token match's
      tokens as a long copy's, and it was drafted 64 tokens long where it held for 6.

    Each estimate is a running mean that settles into an exponential average (`blend`), from
    `prior` (or per key, `priors`)."""

    POOL_EVENTS = 32  # the most a key's events weigh in `monotone`: its estimate follows its last ~30

    def __init__(self, prior: float, runs: Sequence[int] | None = None, priors: Sequence[float] | None = None) -> None:
        if runs is not None and (not runs or list(runs) != sorted(set(runs)) or runs[0] < 1):
            raise ValueError("runs: increasing match lengths, the first >= 1")
        self.runs = tuple(runs) if runs is not None else None
        n = 3 if self.runs is None else len(self.runs) + 1
        if priors is not None and len(priors) != n:
            raise ValueError(f"priors: one per key ({n})")
        self.estimates = [float(v) for v in priors] if priors is not None else [prior] * n
        self.events = [0] * n
        self._pooled: tuple[tuple, list[float]] | None = None  # (estimates and events, `monotone()` of them)

    def key(self, place: int, run: int) -> int:
        """The estimate for the draft token at `place` (0: a step's first) of a step whose first
        token extends a match `run` tokens long (a draft model: the tokens its last steps had
        accepted in a row, 0 after a rejection)."""
        if self.runs is None:
            return 2 if place else int(run > 0)
        return bisect.bisect_right(self.runs, run + place)

    def ahead(self, k: int, run: int) -> list[float]:
        """The acceptance of each of the next step's k draft tokens [k]."""
        if self.runs is None:  # the first token by its step's predecessor, then one rate for the rest
            first, later = self.estimates[self.key(0, run)], self.estimates[self.key(1, run)]
            return [first] + [later] * (k - 1) if k > 0 else []
        held = (*self.estimates, *self.events)  # pooled once per judgement, not per length priced
        if self._pooled is None or self._pooled[0] != held:
            self._pooled = (held, self.monotone())
        estimates, runs = self._pooled[1], self.runs
        return [estimates[bisect.bisect_right(runs, run + i)] for i in range(k)]

    def monotone(self) -> list[float]:
        """A lookup's estimates as a non-decreasing function of the match's length: the closest such
        (least squares, each key weighted by its events, up to `POOL_EVENTS`: pool adjacent
        violators). A longer match goes on at least as often as a shorter one (measured: see
        LOOKUP_PRIORS); estimates that say otherwise are a few recent texts' noise (each follows its
        last ~30 judgements), and one such on the default pair (0.75 at 3-5 tokens, 0.52 at 6-11) had
        a copy drafted by the draft model at ~200 ms a step instead of looked up at ~50."""
        blocks: list[list[float]] = []  # [mean, weight, keys]
        for value, events in zip(self.estimates, self.events):
            blocks.append([value, 1.0 + min(events, self.POOL_EVENTS), 1])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                (v1, w1, n1), (v2, w2, n2) = blocks.pop(-2), blocks.pop()
                blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
        return [value for value, _, n in blocks for _ in range(n)]

    def judge(self, place: int, run: int, ok: bool, blend: Callable[[float, bool, int], float]) -> None:
        key = self.key(place, run)
        self.events[key] += 1
        self.estimates[key] = blend(self.estimates[key], ok, self.events[key])

    def state(self) -> dict[str, Any]:
        if self.runs is None:  # the keys kept since before the runs layout
            return {"first_acceptance_fresh": self.estimates[0], "first_acceptance_aligned": self.estimates[1],
                    "later_acceptance": self.estimates[2], "first_events_fresh": self.events[0],
                    "first_events_aligned": self.events[1], "later_events": self.events[2]}
        return {"runs": list(self.runs), "run_acceptance": list(self.estimates), "run_events": list(self.events)}

    def load(self, state: Mapping[str, Any]) -> None:
        """From `state()`. One kept in another layout (a draft model's for a lookup, other spans of
        match length) is left out: the priors stay, rather than rates learned over other places."""
        if list(state.get("runs") or []) != list(self.runs or []):
            return
        if self.runs is None:
            estimates = [float(state[k]) for k in ("first_acceptance_fresh", "first_acceptance_aligned", "later_acceptance")]
            events = [max(0, int(state[k])) for k in ("first_events_fresh", "first_events_aligned", "later_events")]
        else:
            estimates = [float(v) for v in state["run_acceptance"]]
            events = [max(0, int(v)) for v in state["run_events"]]
        if len(estimates) != len(self.estimates) or len(events) != len(self.events):
            raise ValueError("malformed acceptance state")
        if not all(0.0 <= v <= 1.0 for v in estimates):
            raise ValueError("malformed acceptance state")
        self.estimates, self.events = estimates, events


# sampling regimes: greedy, or sampled at a temperature in one of these bands (edges inclusive above)
TEMPERATURE_EDGES = (0.25, 0.55, 0.85, 1.15)
ACCEPTANCE_LAYOUT = 2  # the acceptance state's layout: estimates per regime (1: one for every regime)
MAX_RETRY_WAIT = 64  # requests an idle regime that pays in the long run waits at most between re-tries


@dataclass(frozen=True)
class Regime:
    """How a request samples, as far as its drafts' acceptance goes. A draft's tokens are accepted
    far less often when the oracle samples than when it takes its argmax (the default pair: ~95%
    greedy, 76-84% at temperature 1), more often when top-k / top-p / min-p cut the distribution's
    tail, and more under a grammar (its forced tokens are drafted for free): estimates learned in one
    regime price another wrong. One estimate for all had 40 short requests at temperature 1 (what
    an OpenAI client sends when it sets none) switch drafting off for the greedy ones after them.

    `band`: 0 greedy (seeded sampling too is at a temperature), else 1 + the index of the first of
    TEMPERATURE_EDGES at or above the temperature (len(TEMPERATURE_EDGES) + 1 above them all)."""

    band: int = 0
    filtered: bool = False  # a top-k, top-p or min-p filter (sampled only)
    constrained: bool = False  # a JSON schema or grammar

    @classmethod
    def of(cls, sampling: SamplingParams, *, constrained: bool = False) -> "Regime":
        if sampling.greedy:
            return cls(0, False, constrained)
        band = 1 + bisect.bisect_left(TEMPERATURE_EDGES, sampling.temperature)
        filtered = sampling.top_k > 0 or sampling.top_p < 1.0 or sampling.min_p > 0.0 or bool(sampling.logit_bias)
        return cls(band, filtered, constrained)

    def describe(self) -> str:
        """For people: "greedy", "temperature 0.85-1.15, top-k/p/min-p", "greedy, grammar"."""
        if self.band == 0:
            text = "greedy"
        else:
            edges = (0.0,) + TEMPERATURE_EDGES
            text = (f"temperature {edges[self.band - 1]:g}-{edges[self.band]:g}" if self.band < len(edges)
                    else f"temperature > {edges[-1]:g}")
            if self.filtered:
                text += ", top-k/p/min-p"
        return text + (", grammar" if self.constrained else "")

    def state(self) -> dict[str, Any]:
        return {"band": self.band, "filtered": self.filtered, "constrained": self.constrained}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> "Regime":
        band = int(state["band"])
        if not 0 <= band <= len(TEMPERATURE_EDGES) + 1:
            raise ValueError("malformed regime")
        return cls(band, bool(state["filtered"]) and band > 0, bool(state["constrained"]))


GREEDY = Regime()


class Estimates:
    """What a length policy learned of one regime's drafts: the acceptance (overall, by place, and
    over the long run), the continuation, the trials behind them, and the regime's probe account
    (each regime probes and re-tries within its own budget: another's history cannot switch it off,
    and an idle one cannot spend a drafting one's budget)."""

    def __init__(self, prior_acceptance: float, prior_continuation: float,
                 runs: Sequence[int] | None = None, place_priors: Sequence[float] | None = None) -> None:
        self.acceptance = prior_acceptance  # a: per drafted token, given the previous ones were accepted
        # the same split by place, for E(k) (`AcceptanceByPlace`)
        self.by_place = AcceptanceByPlace(prior_acceptance, runs, place_priors)
        self.long_acceptance = prior_acceptance  # a over the last few hundred trials: does drafting pay at all?
        self.continuation = prior_continuation  # c: the draft proposes one more token (allowance left)
        self.continuation_accepted = prior_continuation  # c_acc: the same, after a token that was accepted
        self.continuation_events = self.continuation_accepted_events = 0  # outcomes behind each
        self.trials = 0  # draft tokens judged, ever (in earlier processes too)
        self.fresh_trials = 0  # since the start or the last re-try
        self.time_spent = 0.0  # seconds, every step (in earlier processes too)
        self.probe_time = 0.0  # seconds that probes took beyond a plain oracle step (the same)
        self.exploring = False  # re-trying: until min_trials are judged, what drafting costs is probe time
        # requests to wait, and waited, before an idle regime re-tries whatever its probe budget says
        self.retry_wait, self.since_retry = 1, 0
        self.idle_steps = 0  # consecutive k = 0 steps
        self.since_probe = 0  # ... since the last probe (or the last chance of one)
        self.rechecks = 0  # rechecks in a row, while idle, that found no acceptance would pay
        self.drafting = False  # the last step drafted: drafting goes on more easily than it starts

    def cap_probe_bank(self, budget: float, bank: float) -> None:
        """Unused probe budget carries over from the last `bank` seconds only: after a long stretch
        of drafting (or many processes' worth of it), an idle policy probes at the budget's pace,
        not in a burst."""
        self.probe_time = max(self.probe_time, budget * (self.time_spent - bank))

    def state(self) -> dict[str, Any]:
        return {"acceptance": self.acceptance, "long_acceptance": self.long_acceptance, **self.by_place.state(),
                "continuation": self.continuation, "continuation_accepted": self.continuation_accepted,
                "trials": self.trials, "time_spent": self.time_spent, "probe_time": self.probe_time,
                "continuation_events": self.continuation_events,
                "continuation_accepted_events": self.continuation_accepted_events,
                "retry_wait": self.retry_wait, "since_retry": self.since_retry}

    def load(self, state: Mapping[str, Any], *, min_trials: int) -> None:
        """From `state()`; its trials count as evidence up to `min_trials` of it."""
        values = [float(state[k]) for k in ("acceptance", "long_acceptance", "continuation", "continuation_accepted")]
        if not all(0.0 <= v <= 1.0 for v in values):
            raise ValueError("malformed acceptance state")
        self.acceptance, self.long_acceptance, self.continuation, self.continuation_accepted = values
        self.by_place.load(state)
        self.trials = max(0, int(state.get("trials", 0)))
        # the probe budget's account goes on too: a process shorter than a probe's cost / budget
        # (a one-shot `generate` of a few seconds) must not probe every time on a pair known idle
        ledger = [float(state.get(k, 0.0)) for k in ("time_spent", "probe_time")]
        if not all(math.isfinite(v) and v >= 0.0 for v in ledger):
            raise ValueError("malformed acceptance state")
        self.time_spent, self.probe_time = ledger[0], min(ledger)
        self.fresh_trials = min(self.trials, min_trials)
        self.continuation_events = max(0, int(state.get("continuation_events", 0)))
        self.continuation_accepted_events = max(0, int(state.get("continuation_accepted_events", 0)))
        self.retry_wait = min(MAX_RETRY_WAIT, max(1, int(state.get("retry_wait", 1))))
        self.since_retry = max(0, int(state.get("since_retry", 0)))


@dataclass(frozen=True)
class BatchPrice:
    """What a sequence's draft costs when the oracle's pass carries other sequences too (the
    engine's batch): the policy then weighs each draft against the time it adds to the shared pass,
    at the rate the batch makes without drafting, instead of against a pass of its own.

    A sequence of a batch of S gets `base`, a plain pass of the batch over S (its share of plain
    batched decoding: what its k = 0 costs); each more token in the pass adds `verify_token`; the
    draft model drafts for every drafting sequence together, a round per draft position, each round
    `draft_round` (shared by the `drafting` sequences expected to draft) plus `draft_token` per token
    in it. A cache of a stream per sequence runs a batch whose sequences carry different numbers of
    tokens as several passes (`llama.LlamaContext.ubatches`): the drafting sequences share `split`,
    one more pass's overhead, when some do not draft. With one sequence the engine prices nothing:
    the pass and the draft are its own."""

    base: float
    verify_token: float
    draft_round: float
    draft_token: float
    drafting: float = 1.0
    split: float = 0.0

    sequences: int = 1  # in the pass

    def verify_times(self, ns: Sequence[float]) -> list[float]:
        """Seconds for this sequence's share of a pass when it carries ns [m] tokens of it: beside
        the sequences that do not draft, the ones that do cost the pass llama.cpp splits off for
        their extra tokens (`LlamaContext.ubatches`), which they share (none when all of them draft)."""
        drafting = min(max(1.0, self.drafting), float(self.sequences))
        share = self.split * (self.sequences - drafting) / (self.sequences * drafting) if self.sequences > 1 else 0.0
        return [self.base + self.verify_token * (n - 1.0) + (share if n > 1 else 0.0) for n in ns]

    def draft_times(self, lengths: Sequence[float], evaluated: Sequence[float]) -> list[float]:
        """Seconds this sequence adds to the drafting rounds for drafts of `lengths` [m] tokens that
        evaluate `evaluated` [m] draft tokens."""
        per_round = self.draft_round / max(1.0, self.drafting)
        return [per_round * n + self.draft_token * e for n, e in zip(lengths, evaluated)]


class Learned:
    """What a source's length policy learned, shared by every request's fork of it, and how each
    outcome teaches it: the pass costs fitted (`costs.PassCost`), the draft's catch-up, the prior
    guess of a draft token's cost, and each sampling regime's `Estimates` (from `prior_acceptance`
    and `prior_continuation`; `runs`, `place_priors`: a lookup's layout, see `AcceptanceByPlace`).
    What it keeps between processes is `cost_state()`."""

    def __init__(self, *, prior_acceptance: float = 0.9, prior_continuation: float = 1.0,
                 runs: Sequence[int] | None = None, place_priors: Sequence[float] | None = None,
                 prior_weight: float = 4.0, decay: float = 0.97, long_decay: float = 0.995,
                 draft_cost_ratio: float = 0.5, model_draft: bool = True) -> None:
        # how outcomes teach the estimates
        self.prior_acceptance, self.prior_continuation = prior_acceptance, prior_continuation
        self.runs, self.place_priors = runs, place_priors
        self.prior_weight = prior_weight  # the prior (or, on a re-try, the old estimate) counts as this many trials
        self.decay = decay
        self.long_decay = long_decay
        self.model_draft = model_draft  # False: proposing costs the same whatever is proposed (lookup)
        # what is learned
        self.verify_cost = PassCost(VERIFY_SHAPE)  # seconds for an oracle pass of n tokens at a context
        self.draft_cost = PassCost(DRAFT_SHAPE)  # seconds for a proposal that evaluates n draft tokens
        self.draft_round_cost = PassCost(DRAFT_ROUND_SHAPE)  # seconds for a draft decode of several sequences
        self.catch_up = 1.5  # tokens a draft model catches up on before it drafts (the last step's accepted + 1)
        self.draft_cost_ratio = draft_cost_ratio  # a draft token / a one-token oracle pass, until measured
        self.estimates: dict[Regime, Estimates] = {}

    def of(self, regime: Regime) -> Estimates:
        """What is known of `regime`'s drafts (the priors, for one not met before)."""
        est = self.estimates.get(regime)
        if est is None:
            est = self.estimates[regime] = Estimates(self.prior_acceptance, self.prior_continuation,
                                                     self.runs, self.place_priors)
        return est

    @property
    def judged(self) -> bool:
        """Whether a draft token was judged in any regime (there is something to keep)."""
        return any(est.trials for est in self.estimates.values())

    # -- acceptance and continuation

    def judge(self, est: Estimates, trials: int, n_accepted: int, run: int) -> None:
        """Teach `est` `trials` draft tokens of a step whose first one extended a match `run` tokens
        long (see `AcceptanceByPlace.key`), the first `n_accepted` accepted."""
        for i in range(trials):
            ok = i < n_accepted
            est.trials += 1
            est.fresh_trials += 1
            est.acceptance = self._blend(est.acceptance, ok, est.fresh_trials)
            weight = max(1.0 - self.long_decay, 1.0 / (self.prior_weight + est.trials))
            est.long_acceptance += weight * (ok - est.long_acceptance)
            est.by_place.judge(i, run, ok, self._blend)

    def observe_continuation(self, est: Estimates, n_drafted: int, n_accepted: int, *, allowance: int) -> None:
        """After each drafted token the draft went on (it is not the last) or stopped (the last, short
        of the allowance); the last token of a draft that used its whole allowance tells nothing."""
        for i in range(1, n_drafted + 1):
            went_on = i < n_drafted
            if not went_on and n_drafted == allowance:
                break
            est.continuation_events += 1
            est.continuation = self._blend(est.continuation, went_on, est.continuation_events)
            if i <= n_accepted:
                est.continuation_accepted_events += 1
                est.continuation_accepted = self._blend(est.continuation_accepted, went_on,
                                                        est.continuation_accepted_events)

    def _blend(self, estimate: float, outcome: bool, n: int) -> float:
        """A running mean over the n outcomes so far (the prior counting as prior_weight of them)
        that settles into an exponential average: each outcome weighs at least 1 - decay."""
        weight = max(1.0 - self.decay, 1.0 / (self.prior_weight + n))
        return estimate + weight * (outcome - estimate)

    # -- the pass costs

    def observe_step(self, step: StepRecord) -> None:
        """A step's verify pass, its own (not shared with other sequences: those are observed once
        for the batch, `observe_pass`), and its proposal."""
        self.verify_cost.observe(step.drafted + 1, step.context, step.verify_time)
        self._observe_draft_cost(step)

    def _observe_draft_cost(self, step: StepRecord) -> None:
        """A step's proposal is a sample of the draft's cost at the tokens it evaluated: its catch-up
        of one or two tokens (which updates `catch_up`), then a decode per drafted token but the
        last. A proposal that first evaluated more (a probe's window of recent text, a re-try's or a
        new prompt's catch-up) is left out: those tokens go through as one batch, at another rate
        per token than decoding, and a few such samples priced every draft token at 2-4x its cost
        on the default pair, which kept the policy idle (so it probed, and learned more of them)."""
        if not step.drafted:
            return
        if not self.model_draft:
            self.draft_cost.observe(1, step.context, step.draft_time)
            return
        caught_up = step.draft_evaluated - step.drafted + 1
        if not 1 <= caught_up <= 4:  # a probe's window, a re-try's or a prompt's: a batch, another rate
            return
        self.draft_cost.observe(max(1, step.draft_evaluated), step.context, step.draft_time)
        if caught_up <= 2:
            # NOTE: the catch-up of a proposal after the draft's own step: its bonus token, and its last
            # drafted one when all were accepted. A longer one follows prompt lookup's tokens, a cost
            # of that step's source (the proposal is still a sample of the draft's cost above): counted
            # here, a hybrid whose lookup drafted often priced every later draft a token dearer
            self.catch_up += 0.1 * (caught_up - self.catch_up)

    def observe_pass(self, passes: Sequence[tuple[Sequence[int], Sequence[int]]], seconds: float) -> None:
        """An oracle decode of several sequences, which llama.cpp ran as `passes` (its ubatches: the
        tokens of each sequence in it and their contexts), took `seconds`."""
        self.verify_cost.observe_passes(passes, seconds)

    def observe_draft_round(self, passes: Sequence[tuple[Sequence[int], Sequence[int]]], seconds: float) -> None:
        """A draft decode (a round of drafting, one sequence's or several's) took `seconds`."""
        self.draft_round_cost.observe_passes(passes, seconds)

    def observe_draft(self, evaluated: int, context: int, seconds: float) -> None:
        """A draft-model proposal that evaluated `evaluated` tokens at `context`, timed apart from a
        step (`runtime.calibrate`). Measured beside the oracle's passes, it also sets the prior guess
        of a draft token's cost (`draft_cost_ratio`) where it is dearer than guessed: a re-try prices
        the draft at the lower of its fit and that guess, and a guess from the models' sizes (0.4 of
        an oracle pass for the default pair) priced a draft that costs 1.3 of them on a GPU (both
        models launch-bound) as paying."""
        if not self.model_draft:
            return
        self.draft_cost.observe(evaluated, context, seconds)
        if self.verify_cost.ready:
            per_token = seconds / max(1.0, DRAFT_SHAPE[0] + DRAFT_SHAPE[2] * evaluated)
            self.draft_cost_ratio = max(self.draft_cost_ratio, per_token / self.verify_cost(1, context))

    def decode_time(self, passes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> float | None:
        """Seconds an oracle decode run as `passes` would take; None before a pass was measured."""
        return self.verify_cost.decode_time(passes) if self.verify_cost.ready else None

    def needs_costs(self) -> tuple[bool, bool]:
        """Whether the oracle's pass costs, and the draft model's, are still to be measured."""
        return not self.verify_cost.ready, self.model_draft and not self.draft_cost.ready

    def draft_times_alone(self, sizes: Sequence[float], context: int, *, optimistic: bool = False) -> list[float]:
        """Seconds for proposals that evaluate `sizes` [m] draft tokens, drafting alone.
        `optimistic`: the lower of the fitted cost and the prior guess."""
        per_token = self.draft_cost_ratio * self.verify_cost(1, context)  # the prior guess
        guess = [per_token * (DRAFT_SHAPE[0] + DRAFT_SHAPE[2] * n) for n in sizes]
        if not self.draft_cost.ready:
            return guess  # not measured yet
        fitted = self.draft_cost.times(sizes, context)
        return [min(f, g) for f, g in zip(fitted, guess)] if optimistic else fitted

    def batch_price(self, contexts: Sequence[int], context: int, drafting: float) -> BatchPrice | None:
        """The price of a draft for a sequence at `context` whose pass carries the sequences at
        `contexts` (its own among them), `drafting` of them expected to draft with the model; None
        before a pass was measured."""
        if not self.verify_cost.ready:
            return None
        base = self.verify_cost.pass_time([1] * len(contexts), contexts) / len(contexts)
        verify_token = self.verify_cost.token_time(context)
        rounds = self.draft_round_cost
        if rounds.ready:
            one = rounds.pass_time([1], [context])
            draft_token = rounds.token_time(context) + rounds.sequence_time()
            draft_round = max(0.0, one - rounds.token_time(context))
        else:  # no batched drafting measured yet: a draft token alone, split as the prior shape says
            one, two = self.draft_times_alone([1.0, 2.0], context)
            alone = two - one
            split = DRAFT_ROUND_SHAPE[2] / (DRAFT_ROUND_SHAPE[0] + DRAFT_ROUND_SHAPE[2])
            draft_token, draft_round = alone * split, alone * (1.0 - split)
        return BatchPrice(base, verify_token, draft_round, draft_token, drafting,
                          split=self.verify_cost.pass_overhead(context), sequences=len(contexts))

    # -- persistence (the engine keeps these between processes)

    def cost_state(self) -> dict[str, dict[str, Any]]:
        """The fitted costs once measured, the acceptance once a draft token was judged."""
        state = {}
        if self.verify_cost.ready:
            state["verify"] = self.verify_cost.state()
        if self.draft_cost.ready:
            state["draft"] = {**self.draft_cost.state(), "guess_ratio": self.draft_cost_ratio}
        if self.draft_round_cost.ready:
            state["draft_round"] = self.draft_round_cost.state()
        if self.judged:
            state["acceptance"] = self._acceptance_state()
        return state

    def load_cost_state(self, kind: str, state: Mapping[str, Any], *, min_trials: int, probe_budget: float,
                        probe_bank: float) -> None:
        """Go on from an earlier process's `cost_state()[kind]`; its acceptance trials count as
        evidence up to `min_trials` of it, its probe account is capped (`Estimates.cap_probe_bank`)."""
        if kind == "acceptance":
            self._load_acceptance_state(state, min_trials=min_trials, probe_budget=probe_budget,
                                        probe_bank=probe_bank)
        elif kind in ("verify", "draft", "draft_round"):
            {"verify": self.verify_cost, "draft": self.draft_cost, "draft_round": self.draft_round_cost}[kind].load(state)
            if kind == "draft" and "guess_ratio" in state:  # as measured here (observe_draft), if dearer
                self.draft_cost_ratio = max(self.draft_cost_ratio, min(4.0, float(state["guess_ratio"])))
        else:
            raise ValueError(f"unknown cost state {kind!r}")

    def _acceptance_state(self) -> dict[str, Any]:
        """Each regime's estimates that a draft token was judged in, and the draft's catch-up."""
        return {"layout": ACCEPTANCE_LAYOUT, "catch_up": self.catch_up,
                "regimes": [{**regime.state(), **est.state()} for regime, est in self.estimates.items() if est.trials]}

    def _load_acceptance_state(self, state: Mapping[str, Any], *, min_trials: int, probe_budget: float,
                               probe_bank: float) -> None:
        """Go on from an earlier process's estimates: they count as evidence (up to `min_trials`
        of it), so a regime known not to pay starts idle and one known to pay drafts at once. A
        state of an older layout raises ValueError (its one estimate for every regime was learned
        from greedy and sampled requests alike: it is dropped, not guessed apart)."""
        if state.get("layout") != ACCEPTANCE_LAYOUT:
            raise ValueError("an acceptance state of an older layout")
        loaded = {}
        for entry in state["regimes"]:
            est = Estimates(self.prior_acceptance, self.prior_continuation, self.runs, self.place_priors)
            est.load(entry, min_trials=min_trials)
            est.cap_probe_bank(probe_budget, probe_bank)
            loaded[Regime.from_state(entry)] = est
        self.catch_up = min(4.0, max(1.0, float(state.get("catch_up", self.catch_up))))
        self.estimates.clear()
        self.estimates.update(loaded)
