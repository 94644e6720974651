"""Draft-length policies: which source drafts the next step and at most how many tokens (0: a
plain oracle step).

Contract (`LengthPolicy`): a request runs on `fork(regime)` of the engine's policy; before each
step the engine hands it the proposer's `Offer` and gets a `DraftPlan` back (`plan`), after it the
step's `StepRecord` (`observe`); `explain()` says in numbers why drafting is idle. A policy decides
how many tokens each verify pass carries, never which are emitted. `FixedLength(k)` drafts k every
step. `AdaptiveLength`, the default, drafts the k that maximises expected tokens per second at this
context, from pass costs fitted to every step (`costs.PassCost`) and acceptance estimates kept per
sampling regime (`Regime`), drafts nothing unless that beats the oracle alone by `min_gain`, and
probes within `probe_budget` while idle; `HybridLength` / `LookupLength` weigh a draft model against
the model-free sources (prompt lookup, the suffix cache). What a policy learned persists between
processes (`Learning`). The reasoning and the measured figures: docs/policy.md.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from localspec.speculative.costs import START as COST_START, DRAFT_ROUND_SHAPE, DRAFT_SHAPE, VERIFY_SHAPE, PassCost, \
    expected_tokens_by_place, fit_line
from localspec.outputs import DraftSource, StepRecord
from localspec.speculative.plan import NO_DRAFT, DraftPlan, Offer, SharedPass, plain_plan
from localspec.speculative.sampling import SamplingParams


class LengthPolicy(Protocol):
    """What the engine asks of every draft-length policy: a plan before each step, the step's
    record after it. A request runs on a fork of the engine's policy."""

    def plan(self, offer: Offer, limit: int, context: int, shared: SharedPass | None = None) -> DraftPlan:
        """Which source drafts the coming step and at most how many tokens (0..limit) from what the
        proposer `offer`s; `context`: the tokens the oracle holds before the verify pass; `shared`:
        the other sequences the pass carries (None: the pass is this sequence's own)."""

    def observe(self, step: StepRecord) -> None:
        """The outcome of the step just verified."""

    def fork(self, regime: "Regime | None" = None) -> "LengthPolicy":
        """The policy of one more request: what it learned shared, a request state of its own.
        `regime`: how the request samples, for a request that drafts (None: it drafts nothing)."""

    @property
    def idle(self) -> bool:
        """Whether the policy expects to draft nothing in the coming steps (a probe aside)."""

    def explain(self) -> str | None:
        """Why the policy drafts nothing now, for people; None when it has nothing to say."""

    def describe(self) -> str:
        """How the draft length is chosen, for people (the chat's /stats)."""


@runtime_checkable
class Learning(Protocol):
    """A policy that learns from the steps, and what the engine does with what it learned: the
    passes shared by several sequences, the draft decodes, kept between processes."""

    def observe_pass(self, passes, seconds: float) -> None:
        """An oracle decode shared by several sequences (each `StepRecord` of it has batch_seqs > 1),
        run as `passes` (llama.cpp's ubatches: each sequence's tokens in it, their contexts)."""

    def observe_draft_round(self, passes, seconds: float) -> None:
        """A draft decode (a round of drafting), run as `passes`."""

    def decode_time(self, passes) -> float | None:
        """Seconds an oracle decode run as `passes` would take, as the policy learned its passes;
        None before it measured one."""

    def observe_draft(self, evaluated: int, context: int, seconds: float) -> None:
        """A draft-model proposal that evaluated `evaluated` tokens at `context`, timed apart from a
        step (`runtime.calibrate`)."""

    def needs_costs(self) -> tuple[bool, bool]:
        """Whether the oracle's pass costs, and the draft model's, are still to be measured (none
        learned here nor kept from an earlier process)."""

    def known_regimes(self) -> list[dict[str, Any]]:
        """What the policy knows of each sampling regime it met, for people (`localspec check`)."""

    def cost_state(self) -> dict[str, dict[str, Any]]:
        """What the policy learned that is worth keeping between processes, by kind ("verify",
        "draft", "acceptance"; the engine keys each by what it depends on); empty: nothing."""

    def load_cost_state(self, kind: str, state: Mapping[str, Any]) -> None:
        """Go on from an earlier process's `cost_state()[kind]` (a malformed one raises KeyError,
        TypeError or ValueError)."""


@functools.cache
def _learns(cls: type) -> bool:
    return issubclass(cls, Learning)


def learns(policy: object) -> bool:
    """Whether `policy` is `Learning`: a protocol check costs 13-26 µs, once a class here (the
    engine asks every step)."""
    return _learns(type(policy))


class FixedLength:
    """Always draft `k` tokens (fewer near max_tokens or the end of the context): prompt lookup's
    where it found some, else the draft model's (`plan.plain_plan`)."""

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError("draft length must be >= 0")
        self.k = k

    def plan(self, offer: Offer, limit: int, context: int = 0, shared: SharedPass | None = None) -> DraftPlan:
        return plain_plan(offer, min(self.k, limit))

    def observe(self, step: StepRecord) -> None:
        pass  # learns nothing

    def fork(self, regime: "Regime | None" = None) -> "FixedLength":
        return self  # no state of its own

    @property
    def idle(self) -> bool:
        return self.k == 0

    def explain(self) -> str | None:
        return "a fixed draft length of 0" if self.k == 0 else None

    def describe(self) -> str:
        return f"{self.k} (FixedLength)"


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

    def key(self, place: int, run: int) -> int:
        """The estimate for the draft token at `place` (0: a step's first) of a step whose first
        token extends a match `run` tokens long (a draft model: the tokens its last steps had
        accepted in a row, 0 after a rejection)."""
        if self.runs is None:
            return 2 if place else int(run > 0)
        return bisect.bisect_right(self.runs, run + place)

    def ahead(self, k: int, run: int) -> np.ndarray:
        """The acceptance of each of the next step's k draft tokens [k]."""
        estimates = self.estimates if self.runs is None else self.monotone()
        return np.array([estimates[self.key(i, run)] for i in range(k)], dtype=np.float64)

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

    def verify_times(self, ns: np.ndarray) -> np.ndarray:
        """Seconds for this sequence's share of a pass when it carries ns [m] tokens of it: beside
        the sequences that do not draft, the ones that do cost the pass llama.cpp splits off for
        their extra tokens (`LlamaContext.ubatches`), which they share (none when all of them draft)."""
        ns = np.asarray(ns, dtype=np.float64)
        drafting = min(max(1.0, self.drafting), float(self.sequences))
        share = self.split * (self.sequences - drafting) / (self.sequences * drafting) if self.sequences > 1 else 0.0
        return self.base + self.verify_token * (ns - 1.0) + (ns > 1) * share

    def draft_times(self, lengths: np.ndarray, evaluated: np.ndarray) -> np.ndarray:
        """Seconds this sequence adds to the drafting rounds for drafts of `lengths` [m] tokens that
        evaluate `evaluated` [m] draft tokens."""
        return (self.draft_round / max(1.0, self.drafting)) * np.asarray(lengths, dtype=np.float64) \
            + self.draft_token * np.asarray(evaluated, dtype=np.float64)


class Learned:
    """What a length policy learned that every request shares (each request's `fork` of the policy
    reads and teaches the same): the pass costs, the draft's catch-up, each regime's estimates."""

    def __init__(self) -> None:
        self.verify_cost = PassCost(VERIFY_SHAPE)  # seconds for an oracle pass of n tokens at a context
        self.draft_cost = PassCost(DRAFT_SHAPE)  # seconds for a proposal that evaluates n draft tokens
        self.draft_round_cost = PassCost(DRAFT_ROUND_SHAPE)  # seconds for a draft decode of several sequences
        self.catch_up = 1.5  # tokens a draft model catches up on before it drafts (the last step's accepted + 1)
        self.estimates: dict[Regime, Estimates] = {}


class AdaptiveLength:
    """Cost-aware draft length (see the module docstring)."""

    def __init__(self, *, k_max: int = 16, prior_acceptance: float = 0.9, prior_continuation: float = 1.0,
                 prior_weight: float = 4.0, draft_cost_ratio: float = 0.5, model_draft: bool = True,
                 decay: float = 0.97, probe_every: int = 16, probe_budget: float = 0.01, probe_length: int = 2,
                 min_trials: int = 8, min_gain: float = 0.10, keep_gain: float = 0.05,
                 long_decay: float = 0.995, probe_bank: float = 30.0, runs: Sequence[int] | None = None,
                 place_priors: Sequence[float] | None = None, text_weight: float | None = None,
                 name: str | None = None) -> None:
        self.k_max = k_max
        self.name = name or ("draft model" if model_draft else "prompt lookup")  # the source, for people
        # what is learned of each sampling regime's drafts (`Estimates`), each from these priors
        # (`runs`, `place_priors`: a lookup's layout, see `AcceptanceByPlace`)
        self.prior_acceptance, self.prior_continuation = prior_acceptance, prior_continuation
        self.runs, self.place_priors = runs, place_priors
        self.learned = Learned()
        self.regime = GREEDY  # the running request's
        self.est = self.estimates_of(GREEDY)  # ... and what is known of it
        self._run = 0  # the match the next draft extends: a draft model's tokens accepted in a row; a lookup's, given
        self.prior_weight = prior_weight  # the prior (or, on a re-try, the old estimate) counts as this many trials
        self.decay = decay
        self.draft_cost_ratio = draft_cost_ratio  # a draft token / a one-token oracle pass, until measured
        self.model_draft = model_draft  # False: proposing costs the same whatever is proposed (lookup)
        self.probe_every = probe_every  # idle (k = 0) steps before a probe
        self.probe_budget = probe_budget  # most of the time spent that probes may take
        self.probe_bank = probe_bank  # seconds of steps whose unused probe budget carries over
        self.probe_length = probe_length
        self.min_trials = min_trials  # draft tokens judged before the policy may give up on drafting
        self.min_gain = min_gain  # predicted speedup over k = 0 below which drafting is not worth it
        self.keep_gain = keep_gain  # the same for going on drafting (at most min_gain)
        self.long_decay = long_decay
        self.recheck_every = 8  # while idle, judge k afresh every this many steps
        self.retry_weight = 4.0  # on a re-try, the costs' history counts as this many steps
        self._probing = False
        self._hopeless = False  # this request's last recheck found that no acceptance would pay
        self._retry_wanted = False  # a probe was fully accepted: re-try drafting on the whole text
        self._catch_up = False  # the draft must catch up on everything before the next proposal
        self.last_k = 0
        self.context = 0  # the context length of the last step asked about
        # this text's own failures against what the estimates predicted for the same tokens: a
        # text fails g = (w + failed) / (w + predicted) times as often as they say (w: text_weight
        # tokens' worth of belief in the estimates; None: no per-text correction)
        self.text_weight = text_weight
        self._text_failed = self._text_predicted = 0.0
        self.price: BatchPrice | None = None  # set for a step whose pass other sequences share

    # the shared, learned state (see Learned)
    verify_cost = property(lambda self: self.learned.verify_cost,
                           lambda self, cost: setattr(self.learned, "verify_cost", cost))
    draft_cost = property(lambda self: self.learned.draft_cost,
                          lambda self, cost: setattr(self.learned, "draft_cost", cost))
    catch_up = property(lambda self: self.learned.catch_up, lambda self, n: setattr(self.learned, "catch_up", n))
    estimates = property(lambda self: self.learned.estimates)

    def fork(self, regime: Regime | None = None) -> "AdaptiveLength":
        """The policy of one more request running beside others: the same learned state (costs,
        estimates) and settings, a request state of its own (the match it is on, its text's
        failures, a probe or re-try under way), started on `regime` when given."""
        twin = copy.copy(self)
        twin._run, twin.last_k, twin.context = 0, 0, 0
        twin._probing = twin._retry_wanted = twin._catch_up = twin._hopeless = False
        twin._text_failed = twin._text_predicted = 0.0
        twin.price = None
        if regime is not None:
            twin.start_request(regime)
        return twin

    def plan(self, offer: Offer, limit: int, context: int = 0, shared: SharedPass | None = None) -> DraftPlan:
        """The best length now (`draft_length`), drafted by the plain rule (`plan.plain_plan`)."""
        self.set_price(self.batch_price(shared.contexts, context, shared.drafting) if shared is not None else None)
        k = self.draft_length(limit, context)
        if k <= 0:
            return NO_DRAFT
        return dataclasses.replace(plain_plan(offer, k), resync=self.consume_catch_up(), probe=self._probing)

    def estimates_of(self, regime: "Regime") -> "Estimates":
        """What is known of `regime`'s drafts (the priors, for one not met before)."""
        est = self.estimates.get(regime)
        if est is None:
            est = self.estimates[regime] = Estimates(self.prior_acceptance, self.prior_continuation,
                                                     self.runs, self.place_priors)
        return est

    @property
    def idle(self) -> bool:
        if not self.verify_cost.ready or self.best_length(self.k_max, optimistic=self.est.exploring) > 0:
            return False
        return self.est.fresh_trials >= self.min_trials or not self.can_pay(self.k_max, optimistic=self.est.exploring)

    def expected_tokens(self, k: int) -> float:
        return float(self._expected_tokens(k)[k])

    def step_time(self, k: int, context: int | None = None) -> float:
        return float(self._step_times(k, self.context if context is None else context)[k])

    def _expected_tokens(self, k_top: int, acceptance: float | None = None) -> np.ndarray:
        """E(k) for k = 0..k_top [k_top+1]: each draft token at its place's acceptance after a step
        like the last one (`acceptance` given: that one for every token)."""
        ahead = (np.full(k_top, acceptance) if acceptance is not None
                 else self.in_this_text(self.est.by_place.ahead(k_top, self._run)))  # [k_top]
        return expected_tokens_by_place(ahead, self.est.continuation_accepted)

    def in_this_text(self, acceptance: np.ndarray) -> np.ndarray:
        """Acceptance estimates [m] corrected for the text at hand: each failure probability times
        the text's failure ratio so far (see `text_weight`). The estimates follow every text
        alike; texts differ: a copy's lookups hold where an edit's, on matches as long, do not
        (on the bench, the first token 84-100% of the time on copy, grounded and long prompts,
        33% on a code edit)."""
        if self.text_weight is None:
            return acceptance
        ratio = (self.text_weight + self._text_failed) / (self.text_weight + self._text_predicted)
        return np.clip(1.0 - (1.0 - acceptance) * ratio, 0.0, 1.0)

    def evaluated(self, lengths: np.ndarray) -> np.ndarray:
        """Tokens the draft evaluates to propose each of `lengths` [m] (the draft cost's size)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        if not self.model_draft:
            return np.ones_like(lengths)
        return np.maximum(1.0, lengths - 1.0 + self.catch_up)

    def draft_times(self, lengths: np.ndarray, context: int, *, optimistic: bool = False) -> np.ndarray:
        """Seconds for the draft to propose each of `lengths` [m] tokens at `context` [m].
        `optimistic`: the lower of the fitted cost and the prior guess."""
        sizes = self.evaluated(lengths)  # [m]
        if self.price is not None:
            if not self.model_draft:
                return np.zeros(len(sizes))  # a lookup: nothing to decode
            return self.price.draft_times(lengths, sizes)
        return self._draft_times_alone(sizes, context, optimistic=optimistic)

    def _draft_times_alone(self, sizes: np.ndarray, context: int, *, optimistic: bool = False) -> np.ndarray:
        """Seconds for proposals that evaluate `sizes` [m] draft tokens, drafting alone."""
        per_token = self.draft_cost_ratio * self.verify_cost(1, context)  # the prior guess
        guess = per_token * (DRAFT_SHAPE[0] + DRAFT_SHAPE[2] * sizes)
        if not self.draft_cost.ready:
            return guess  # not measured yet
        fitted = self.draft_cost.predict(sizes, context)
        return np.minimum(fitted, guess) if optimistic else fitted

    def _step_times(self, k_top: int, context: int, *, optimistic: bool = False) -> np.ndarray:
        """T(k) for k = 0..k_top [k_top+1] at `context`."""
        lengths = np.arange(1, k_top + 1)  # [K] tokens drafted
        passes = np.arange(1, k_top + 2)  # [K+1] passes of 1..K+1 tokens
        verify = (self.verify_cost.predict(passes, context) if self.price is None
                  else self.price.verify_times(passes))  # [K+1]
        cost = self.draft_times(lengths, context, optimistic=optimistic) + verify[1:]  # [K]
        c = self.est.continuation
        at_least = c ** (lengths - 1)  # [K] P(L >= l)
        stopped = np.concatenate(([0.0], np.cumsum(at_least * (1.0 - c) * cost)))[:-1]  # [K] drafts ending before l
        return np.concatenate((verify[:1], stopped + at_least * cost))

    def rates(self, limit: int, context: int | None = None, *, acceptance: float | None = None,
              optimistic: bool = False) -> np.ndarray:
        """Expected tokens per second for k = 0..min(limit, k_max) [K+1] (needs a measured pass), at
        the running acceptance or the one given (`optimistic`: see draft_times)."""
        k_top = min(limit, self.k_max)
        expected = self._expected_tokens(k_top, acceptance)
        return expected / self._step_times(k_top, self.context if context is None else context,
                                           optimistic=optimistic)

    def can_pay(self, limit: int, context: int | None = None, *, optimistic: bool = False) -> bool:
        """Whether drafting could beat the oracle alone by `min_gain` at all: were every draft token
        accepted, at the costs measured (the prior guess where the draft's is not; `optimistic`: see
        draft_times). Where it could not (a draft that costs as much as its oracle: the default pair
        on a GPU), no acceptance evidence can change that, so nothing is drafted to gather it: no
        first trials, no probes, no re-tries (a re-try, begun at a new request, prices the draft
        optimistically, so a cost measured on a busy machine does not keep it idle for good). True
        before a pass was measured."""
        if limit <= 0:
            return False
        if not self.verify_cost.ready or self.price is not None:
            # NOTE: in a pass other sequences share, a draft's price depends on how many of them draft
            # (`BatchPrice.drafting`), which only drafting teaches: gated, requests four at a time
            # drafted by prompt lookup stopped drafting together and ran 8% slower
            return True
        # a draft cost from fewer than START proposals may be one caught in a stall: the guess bounds it
        settled = not self.model_draft or self.draft_cost.observations >= COST_START
        rate = self.rates(limit, context, acceptance=1.0, optimistic=optimistic or not settled)  # [K+1]
        return bool(rate[1:].max(initial=0.0) >= (1.0 + self.min_gain) * rate[0])

    def best_length(self, limit: int, context: int | None = None, *, optimistic: bool = False) -> int:
        if not self.verify_cost.ready:
            return min(self.probe_length, limit)  # nothing measured yet: try a short draft
        rate = self.rates(limit, context, optimistic=optimistic)  # [K+1]
        k = int(np.argmax(rate))  # the shortest k on a tie
        gain = self.keep_gain if self.est.drafting else self.min_gain  # drafting goes on more easily than it starts
        return k if rate[k] >= (1.0 + gain) * rate[0] else 0

    def start_request(self, regime: Regime | None = None) -> None:
        """A new request begins, sampling as `regime` says (None: greedy): it is priced with that
        regime's estimates, and teaches them alone."""
        regime = GREEDY if regime is None else regime
        if regime != self.regime:  # what the last steps said was of another regime
            self.regime, self.est = regime, self.estimates_of(regime)
            self._retry_wanted = False
        self._run = 0  # nothing drafted yet for this text
        self._text_failed = self._text_predicted = 0.0
        self._hopeless = False
        self.est.since_retry += 1
        if not self.idle or not (self._probe_budget_left() or self.est.since_retry >= self.est.retry_wait):
            return
        # with the draft's cost at the lower of the fitted one and the prior guess: an idle policy
        # stops measuring the draft (a probe drafts from a window, at another rate), so a cost fitted
        # while the machine was busy would otherwise keep it idle for good, in later processes too
        rate = self.rates(self.k_max, acceptance=self.est.long_acceptance, optimistic=True)  # [K+1]
        if rate[1:].max(initial=0.0) >= (1.0 + self.min_gain) * rate[0]:
            self._begin_retry()  # it pays in the long run: judge min_trials draft tokens on this prompt

    @property
    def judged(self) -> bool:
        """Whether a draft token was judged in any regime (there is something to keep)."""
        return any(est.trials for est in self.estimates.values())

    def explain(self, source: str = "the draft") -> str | None:
        """Why this policy drafts nothing now, for people: what the running regime's estimates
        predict at the best draft length against the gain drafting needs (None before a pass
        was measured)."""
        if not self.verify_cost.ready or self.k_max < 1:
            return None
        rate = self.rates(self.k_max)  # [K+1]
        k = 1 + int(np.argmax(rate[1:]))
        need = 1.0 + (self.keep_gain if self.est.drafting else self.min_gain)
        costs = f"an oracle pass {1000 * self.verify_cost(1, self.context):.0f} ms"
        if self.model_draft:
            one, nine = self.draft_times(np.array([1, 9]), self.context)
            costs += f", a draft token {1000 * (nine - one) / 8:.0f} ms"
        return (f"{source}'s estimated acceptance {self.est.acceptance:.0%} ({self.regime.describe()}; {costs}) "
                f"predicts {rate[k] / rate[0]:.2f}x the oracle alone at best (k={k}); drafting needs {need:.2f}x")

    def known_regimes(self) -> list[dict[str, Any]]:
        """What is known of each regime met (here or in earlier processes), for people (`localspec
        check`): its acceptance, the draft tokens judged, and whether it drafts now (if not, why)."""
        own = self.regime, self.est
        out = []
        try:
            for regime, est in self.estimates.items():
                self.regime, self.est = regime, est
                idle = self.idle
                out.append({"source": self.name,
                            "regime": regime.describe(), "acceptance": round(est.acceptance, 3),
                            "trials": est.trials, "drafting": not idle, "why_idle": self.explain() if idle else None})
        finally:
            self.regime, self.est = own
        return out

    def _probe_budget_left(self) -> bool:
        return self.est.probe_time <= self.probe_budget * self.est.time_spent

    def _begin_retry(self) -> None:
        """Judge drafting afresh: min_trials new draft tokens, on costs the re-try measures (not
        the ones that made the policy idle): the draft's history is dropped (its prior's scale
        stays), the oracle's counts as only `retry_weight` steps (its one-token passes went on
        being measured meanwhile)."""
        self.est.fresh_trials = self.est.since_retry = 0
        self.est.exploring = True
        self.draft_cost.soften(0.0)
        self.verify_cost.soften(self.retry_weight)

    def consume_catch_up(self) -> bool:
        wanted, self._catch_up = self._catch_up, False
        return wanted

    @property
    def seeking_evidence(self) -> bool:
        """The length last chosen drafts for evidence, not because drafting is known to pay: a probe,
        a re-try being judged, or the first draft tokens of a regime (`min_trials`)."""
        return self.last_k > 0 and (self._probing or self.est.exploring or self.est.fresh_trials < self.min_trials)

    @property
    def aligned(self) -> bool:
        """The last step drafted something and all of it was accepted: the next step's first token
        runs on (a lookup's copy going on) rather than starting afresh."""
        return self._run > 0

    @property
    def run(self) -> int:
        """The length of the match the next draft extends (see `AcceptanceByPlace.key`)."""
        return self._run

    def forget_alignment(self) -> None:
        """Another source drafted since this policy's last step: its next first token is a fresh one."""
        self._run = 0

    def draft_length(self, limit: int, context: int = 0, *, offered: int | None = None,
                     run: int | None = None) -> int:
        """`offered`: the tokens the proposer has on offer, when it knows them before the length is
        chosen (a lookup's match). Unlike `limit` (the generation's end, the context's), a short
        offer that does not pay is a judgement on the source, and counts toward its idleness.
        `run`: the length of the match the offer extends (`Draft.match_length`)."""
        self._probing = False
        if run is not None:
            self._run = run
        self.context = context
        available = limit if offered is None else min(limit, offered)
        if available <= 0:
            return 0
        if self._retry_wanted:  # at once, while the text is easy; its cost delays the next probes
            self._retry_wanted = False
            if self.can_pay(available):
                self._begin_retry()  # judge min_trials draft tokens afresh, on the whole text
                self._catch_up = True
        # idle, k is judged afresh every recheck_every steps: meanwhile only the oracle's cost moved
        # (a step that rests costs next to nothing: an idle step's host time is the oracle alone's)
        resting = self.est.idle_steps % self.recheck_every and (self.est.fresh_trials >= self.min_trials
                                                               or self._hopeless)
        # a re-try drafts at the length the prior guess of the draft's cost would choose, so what it
        # measures is the cost of the drafts the policy would go on with
        k = 0 if resting else self.best_length(available, optimistic=self.est.exploring)
        if k > 0:
            self.est.idle_steps = 0
        elif resting:
            k = self._idle_step(available)
        elif self.est.fresh_trials < self.min_trials and not self._judge_hopeless(available):
            k = min(self.probe_length, available)  # one or two early rejections are not evidence enough
        elif not self._near_the_end(limit):
            k = self._idle_step(available)
        self.last_k = k
        self.est.drafting = k > 0
        return k

    def _judge_hopeless(self, available: int) -> bool:
        """Whether no acceptance could make drafting pay here (`can_pay`): then this request's
        idle steps rest between rechecks as a judged regime's do."""
        self._hopeless = not self.can_pay(available, optimistic=self.est.exploring)
        return self._hopeless

    def _near_the_end(self, limit: int) -> bool:
        """Too few tokens left for a draft to pay (the generation's end), where a longer one would:
        not a sign of an idle pair."""
        return limit < self.k_max and self.best_length(self.k_max) > 0

    def _idle_step(self, available: int) -> int:
        """k for a step where no draft pays: 0, or a probe's short draft every `probe_every` such
        steps while the probe budget allows."""
        self.est.idle_steps += 1
        if self.est.idle_steps < self.probe_every or not self._probe_budget_left():
            return 0
        self.est.idle_steps = 0
        if not self.can_pay(available):
            return 0  # no acceptance a probe could find would pay
        self._probing = True
        return min(self.probe_length, available)

    def observe(self, step: StepRecord) -> None:
        n_drafted, n_accepted = step.drafted, step.accepted
        spent = step.draft_time + step.verify_time
        self.est.time_spent += spent
        if step.batch_seqs <= 1:  # a shared pass is observed once, for the batch (observe_pass)
            self.verify_cost.observe(n_drafted + 1, step.context, step.verify_time)
            self._observe_draft_cost(step)
        if self._probing or self.est.exploring:  # exploring's price: beyond the oracle alone's time for its tokens
            self.est.probe_time += max(0.0, spent - (n_accepted + 1) * self.verify_cost(1, step.context))
        self.est.cap_probe_bank(self.probe_budget, self.probe_bank)
        run, self._run = self._run, self._run + n_accepted if 0 < n_drafted == n_accepted else 0
        if self._probing:  # drafted from a window of the text: a biased sample, only a hint
            self._retry_wanted, self._run = self._run > 0, 0
            return
        self._judge(n_accepted + (n_accepted < n_drafted), n_accepted, run)
        if n_drafted:
            self._observe_continuation(n_drafted, n_accepted, allowance=max(self.last_k, n_drafted))

    # -- batches: the engine observes a shared pass once, and prices each sequence's drafts in it

    def set_price(self, price: BatchPrice | None) -> None:
        self.price = price

    def observe_pass(self, passes: Sequence[tuple[Sequence[int], Sequence[int]]], seconds: float) -> None:
        """An oracle decode of several sequences, which llama.cpp ran as `passes` (its ubatches: the
        tokens of each sequence in it and their contexts), took `seconds`."""
        self.verify_cost.observe_passes(passes, seconds)

    def observe_draft_round(self, passes: Sequence[tuple[Sequence[int], Sequence[int]]], seconds: float) -> None:
        """A draft decode (a round of drafting, one sequence's or several's) took `seconds`."""
        self.learned.draft_round_cost.observe_passes(passes, seconds)

    def decode_time(self, passes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> float | None:
        return self.verify_cost.decode_time(passes) if self.verify_cost.ready else None

    def observe_draft(self, evaluated: int, context: int, seconds: float) -> None:
        """(See `Learning`.) Measured beside the oracle's passes, it also sets the prior guess of a
        draft token's cost (`draft_cost_ratio`) where it is dearer than guessed: a re-try prices
        the draft at the lower of its fit and that guess, and a guess from the models' sizes (0.4 of
        an oracle pass for the default pair) priced a draft that costs 1.3 of them on a GPU (both
        models launch-bound) as paying."""
        if not self.model_draft:
            return
        self.draft_cost.observe(evaluated, context, seconds)
        if self.verify_cost.ready:
            per_token = seconds / max(1.0, DRAFT_SHAPE[0] + DRAFT_SHAPE[2] * evaluated)
            self.draft_cost_ratio = max(self.draft_cost_ratio, per_token / self.verify_cost(1, context))

    def needs_costs(self) -> tuple[bool, bool]:
        return not self.verify_cost.ready, self.model_draft and not self.draft_cost.ready

    def batch_price(self, contexts: Sequence[int], context: int, drafting: float) -> BatchPrice | None:
        """The price of a draft for a sequence at `context` whose pass carries the sequences at
        `contexts` (its own among them), `drafting` of them expected to draft with the model; None
        before a pass was measured."""
        if not self.verify_cost.ready:
            return None
        base = self.verify_cost.pass_time([1] * len(contexts), contexts) / len(contexts)
        verify_token = self.verify_cost.token_time(context)
        rounds = self.learned.draft_round_cost
        if rounds.ready:
            one = rounds.pass_time([1], [context])
            draft_token = rounds.token_time(context) + rounds.sequence_time()
            draft_round = max(0.0, one - rounds.token_time(context))
        else:  # no batched drafting measured yet: a draft token alone, split as the prior shape says
            one, two = self._draft_times_alone(np.array([1.0, 2.0]), context)
            alone = float(two - one)
            split = DRAFT_ROUND_SHAPE[2] / (DRAFT_ROUND_SHAPE[0] + DRAFT_ROUND_SHAPE[2])
            draft_token, draft_round = alone * split, alone * (1.0 - split)
        return BatchPrice(base, verify_token, draft_round, draft_token, drafting,
                          split=self.verify_cost.pass_overhead(context), sequences=len(contexts))

    def score_unverified(self, matched: int, compared: int, *, run: int | None = None) -> None:
        """A draft this source offered but did not draft (the other source of a hybrid did), scored
        against the tokens the step emitted: its first `compared` tokens were compared, the first
        `matched` of them agreed. Its acceptance counts as a drafted step's would (nothing was
        spent): a source that is not chosen still learns what the text is like now, so estimates
        kept from other texts (a lookup's from prompts that did not repeat) cannot keep it unchosen
        where it would pay, nor chosen where it would not. `run`: the match the offer's first token
        extended when it was made (default: the one this policy's next draft extends)."""
        if compared <= 0:
            return
        run = self._run if run is None else run
        self._run = run + matched if matched == compared else 0
        self._judge(matched + (matched < compared), matched, run)

    def _judge(self, trials: int, n_accepted: int, run: int) -> None:
        """Learn from `trials` draft tokens of a step whose first one extended a match `run` tokens
        long (see `AcceptanceByPlace.key`), the first `n_accepted` accepted."""
        if self.text_weight is not None and trials:
            self._text_predicted += float(np.sum(1.0 - self.est.by_place.ahead(trials, run)))
            self._text_failed += float(trials - n_accepted)
        for i in range(trials):
            ok = i < n_accepted
            self.est.trials += 1
            self.est.fresh_trials += 1
            self.est.acceptance = self._blend(self.est.acceptance, ok, self.est.fresh_trials)
            weight = max(1.0 - self.long_decay, 1.0 / (self.prior_weight + self.est.trials))
            self.est.long_acceptance += weight * (ok - self.est.long_acceptance)
            self.est.by_place.judge(i, run, ok, self._blend)
        if self.est.fresh_trials >= self.min_trials and self.est.exploring:  # the re-try is judged
            self.est.exploring = False
            # found paying: the next idle stretch may re-try at the next request; not: wait twice as long
            paid = self.best_length(self.k_max) > 0
            self.est.retry_wait = 1 if paid else min(2 * self.est.retry_wait, MAX_RETRY_WAIT)

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

    def _observe_continuation(self, n_drafted: int, n_accepted: int, *, allowance: int) -> None:
        """After each drafted token the draft went on (it is not the last) or stopped (the last, short
        of the allowance); the last token of a draft that used its whole allowance tells nothing."""
        for i in range(1, n_drafted + 1):
            went_on = i < n_drafted
            if not went_on and n_drafted == allowance:
                break
            self.est.continuation_events += 1
            self.est.continuation = self._blend(self.est.continuation, went_on, self.est.continuation_events)
            if i <= n_accepted:
                self.est.continuation_accepted_events += 1
                self.est.continuation_accepted = self._blend(self.est.continuation_accepted, went_on,
                                                         self.est.continuation_accepted_events)

    def _blend(self, estimate: float, outcome: bool, n: int) -> float:
        """A running mean over the n outcomes so far (the prior counting as prior_weight of them)
        that settles into an exponential average: each outcome weighs at least 1 - decay."""
        weight = max(1.0 - self.decay, 1.0 / (self.prior_weight + n))
        return estimate + weight * (outcome - estimate)

    def describe(self) -> str:
        return f"AdaptiveLength (chosen per step{f', up to {self.k_max}' if self.k_max else ''})"

    # -- persistence (the engine keeps these between processes)

    def cost_state(self) -> dict[str, dict[str, Any]]:
        """The fitted costs once measured, the acceptance once a draft token was judged."""
        state = {}
        if self.verify_cost.ready:
            state["verify"] = self.verify_cost.state()
        if self.draft_cost.ready:
            state["draft"] = {**self.draft_cost.state(), "guess_ratio": self.draft_cost_ratio}
        if self.learned.draft_round_cost.ready:
            state["draft_round"] = self.learned.draft_round_cost.state()
        if self.judged:
            state["acceptance"] = self.acceptance_state()
        return state

    def load_cost_state(self, kind: str, state: Mapping[str, Any]) -> None:
        if kind == "acceptance":
            self.load_acceptance_state(state)
        elif kind in ("verify", "draft", "draft_round"):
            {"verify": self.verify_cost, "draft": self.draft_cost,
             "draft_round": self.learned.draft_round_cost}[kind].load(state)
            if kind == "draft" and "guess_ratio" in state:  # as measured here (observe_draft), if dearer
                self.draft_cost_ratio = max(self.draft_cost_ratio, min(4.0, float(state["guess_ratio"])))
        else:
            raise ValueError(f"unknown cost state {kind!r}")

    def acceptance_state(self) -> dict[str, Any]:
        """Each regime's estimates that a draft token was judged in, and the draft's catch-up."""
        return {"layout": ACCEPTANCE_LAYOUT, "catch_up": self.catch_up,
                "regimes": [{**regime.state(), **est.state()} for regime, est in self.estimates.items() if est.trials]}

    def load_acceptance_state(self, state: Mapping[str, Any]) -> None:
        """Go on from an earlier process's estimates: they count as evidence (up to `min_trials`
        of it), so a regime known not to pay starts idle and one known to pay drafts at once. A
        state of an older layout raises ValueError (its one estimate for every regime was learned
        from greedy and sampled requests alike: it is dropped, not guessed apart)."""
        if state.get("layout") != ACCEPTANCE_LAYOUT:
            raise ValueError("an acceptance state of an older layout")
        loaded = {}
        for entry in state["regimes"]:
            est = Estimates(self.prior_acceptance, self.prior_continuation, self.runs, self.place_priors)
            est.load(entry, min_trials=self.min_trials)
            est.cap_probe_bank(self.probe_budget, self.probe_bank)
            loaded[Regime.from_state(entry)] = est
        self.catch_up = min(4.0, max(1.0, float(state.get("catch_up", self.catch_up))))
        self.estimates.clear()
        self.estimates.update(loaded)
        self.est = self.estimates_of(self.regime)


class _FreeSources:
    """What the policies that choose among sources share: an `AdaptiveLength` for each model-free
    source (prompt lookup, the suffix cache; drafts that cost nothing to make, sized by the match
    they follow), each learning its own acceptance from its drafts and from its unused offers."""

    free: dict[DraftSource, AdaptiveLength]

    def _sized(self, offer: Offer, allowance: int, context: int) -> list[tuple[DraftSource, int, AdaptiveLength]]:
        """(source, length, its policy) of each model-free source whose found tokens its policy
        would draft some of, prompt lookup first."""
        out = []
        for source, found in offer.found():
            policy = self.free.get(source)
            n = min(len(found.tokens), allowance)
            k = policy.draft_length(allowance, context, offered=n, run=found.match_length) if policy and n > 0 else 0
            if k > 0:
                out.append((source, k, policy))
        return out

    @staticmethod
    def _fastest(candidates: Sequence[tuple[DraftSource, int, AdaptiveLength]], context: int) -> tuple[DraftSource, int]:
        """The candidate whose length promises the most tokens per second (the first on a tie)."""
        source, k, _ = max(candidates, key=lambda c: c[2].rates(c[1], context)[c[1]])
        return source, k

    def _observe_free(self, step: StepRecord, used: AdaptiveLength, others: Sequence[AdaptiveLength]) -> None:
        """The step's record to the policy of the source that drafted it; the others' next first
        token is a fresh one; the unused offers scored."""
        used.observe(step)
        if step.drafted:
            for policy in others:
                if policy is not used:
                    policy.forget_alignment()
        for score in step.unused:
            policy = self.free.get(score.source)
            if policy is not None:
                policy.score_unverified(score.matched, score.compared, run=score.run)

    def _free_state(self) -> dict[str, dict[str, Any]]:
        return {f"{source}_acceptance": policy.acceptance_state() for source, policy in self.free.items()
                if policy.judged}

    def _load_free_state(self, kind: str, state: Mapping[str, Any]) -> bool:
        source = kind.removesuffix("_acceptance")
        if kind.endswith("_acceptance") and source in self.free:
            self.free[DraftSource(source)].load_acceptance_state(state)
            return True
        return False


def _free_of(lookup: AdaptiveLength | None, suffix: AdaptiveLength | None) -> dict[DraftSource, AdaptiveLength]:
    return {source: policy for source, policy in ((DraftSource.LOOKUP, lookup), (DraftSource.SUFFIX, suffix))
            if policy is not None}


class HybridLength(_FreeSources):
    """The length policy of a draft model with model-free sources beside it (prompt lookup, the
    suffix cache): each with its own `AdaptiveLength` (acceptance, continuation, the draft model's
    cost) over one fit of the oracle's pass costs.

    Each step the model's policy chooses its length (its probes and re-tries included); each
    model-free source that found tokens is sized by its own policy, and the source whose length
    promises the most tokens per second drafts (a model-free one on a tie; k = 0 included). A
    model's draft made for evidence (a probe, a re-try) goes first: no source settles a request
    for good, since the unused offers are scored too (`StepRecord.unused`). A step's record goes to
    the policy of the source that drafted it (an empty draft to the model's: a plain oracle step,
    one of its idle steps)."""

    def __init__(self, model: AdaptiveLength, lookup: AdaptiveLength | None = None,
                 suffix: AdaptiveLength | None = None) -> None:
        self.model, self.lookup, self.suffix = model, lookup, suffix
        self.free = _free_of(lookup, suffix)
        for policy in self.free.values():
            policy.verify_cost = model.verify_cost  # one oracle: all learn its passes

    def fork(self, regime: "Regime | None" = None) -> "HybridLength":
        return HybridLength(self.model.fork(regime), *(p.fork(regime) if p else None for p in (self.lookup, self.suffix)))

    def observe_pass(self, passes, seconds: float) -> None:
        self.model.observe_pass(passes, seconds)  # the other sources' verify cost is the same one

    def observe_draft_round(self, passes, seconds: float) -> None:
        self.model.observe_draft_round(passes, seconds)

    def decode_time(self, passes) -> float | None:
        return self.model.decode_time(passes)

    def observe_draft(self, evaluated: int, context: int, seconds: float) -> None:
        self.model.observe_draft(evaluated, context, seconds)

    def needs_costs(self) -> tuple[bool, bool]:
        return self.model.needs_costs()

    @property
    def idle(self) -> bool:
        return self.model.idle

    def plan(self, offer: Offer, limit: int, context: int = 0, shared: SharedPass | None = None) -> DraftPlan:
        price = self.model.batch_price(shared.contexts, context, shared.drafting) if shared is not None else None
        for policy in (self.model, *self.free.values()):
            policy.set_price(price)
        k_model = self.model.draft_length(limit, context) if limit > 0 else 0
        resync = limit > 0 and self.model.consume_catch_up()
        allowance = min(limit, max(k_model, *(p.k_max for p in self.free.values())))
        source, k = self._choose(offer, allowance, k_model, context)
        if k <= 0 or source == DraftSource.MODEL and not offer.model:
            return DraftPlan(resync=resync)
        return DraftPlan(source, k, resync=resync, probe=source == DraftSource.MODEL and self.model._probing)

    def _choose(self, offer: Offer, allowance: int, k_model: int, context: int) -> tuple[DraftSource, int]:
        """(source, length) for a step, within `allowance`."""
        sized = self._sized(offer, allowance, context)
        if not sized:
            return DraftSource.MODEL, k_model
        if not self.model.verify_cost.ready:
            return sized[0][:2]  # nothing measured yet: the free draft first
        if k_model > 0 and self.model.seeking_evidence:
            # NOTE: the model's probe or re-try runs even where another source has an offer (which
            # is scored all the same): else a request whose text repeats itself keeps to the lookup
            # for its whole answer and the model never tries again (a held-out 400-token story:
            # 1.05x the oracle alone that way, 1.41x with the model's probes let through)
            return DraftSource.MODEL, k_model
        return self._fastest(sized + [(DraftSource.MODEL, k_model, self.model)], context)

    def observe(self, step: StepRecord) -> None:
        self._observe_free(step, self.free.get(step.source, self.model), [self.model, *self.free.values()])

    def explain(self) -> str | None:
        return self.model.explain("the draft model")

    def known_regimes(self) -> list[dict[str, Any]]:
        return [r for policy in (self.model, *self.free.values()) for r in policy.known_regimes()]

    def describe(self) -> str:
        free = " or ".join(f"{_NAMES[s]} up to {p.k_max}" for s, p in self.free.items())
        return f"HybridLength ({free} or the draft model up to {self.model.k_max}, chosen per step)"

    # -- persistence: the model's state as a plain draft model's, the other sources' acceptance beside it

    def cost_state(self) -> dict[str, dict[str, Any]]:
        return {**self.model.cost_state(), **self._free_state()}

    def load_cost_state(self, kind: str, state: Mapping[str, Any]) -> None:
        if not self._load_free_state(kind, state):
            self.model.load_cost_state(kind, state)


_NAMES = {DraftSource.LOOKUP: "prompt lookup", DraftSource.SUFFIX: "the suffix cache"}


class LookupLength(_FreeSources):
    """The length policy of model-free drafting alone (`--draft ngram`: prompt lookup, and the
    suffix cache when it is on): an `AdaptiveLength` in the lookup's layout (`LOOKUP_RUNS`) for each
    source, which sizes each draft by the match it found and how long it is; where both found
    tokens, the one that promises more tokens per second drafts."""

    def __init__(self, lookup: AdaptiveLength | None, suffix: AdaptiveLength | None = None) -> None:
        self.lookup, self.suffix = lookup, suffix
        self.free = _free_of(lookup, suffix)
        if not self.free:
            raise ValueError("LookupLength needs prompt lookup's policy, the suffix cache's or both")
        self.main = lookup if lookup is not None else suffix  # its fit of the oracle's passes serves both
        for policy in self.free.values():
            policy.verify_cost = self.main.verify_cost

    def fork(self, regime: "Regime | None" = None) -> "LookupLength":
        return LookupLength(*(p.fork(regime) if p else None for p in (self.lookup, self.suffix)))

    def observe_pass(self, passes, seconds: float) -> None:
        self.main.observe_pass(passes, seconds)

    def observe_draft_round(self, passes, seconds: float) -> None:
        pass  # nothing to decode

    def decode_time(self, passes) -> float | None:
        return self.main.decode_time(passes)

    def observe_draft(self, evaluated: int, context: int, seconds: float) -> None:
        pass  # no draft model

    def needs_costs(self) -> tuple[bool, bool]:
        return not self.main.verify_cost.ready, False

    @property
    def idle(self) -> bool:
        return all(policy.idle for policy in self.free.values())

    def plan(self, offer: Offer, limit: int, context: int = 0, shared: SharedPass | None = None) -> DraftPlan:
        allowance = min(limit, max(p.k_max for p in self.free.values()))
        if not offer.found() or allowance <= 0:
            return NO_DRAFT
        price = self.main.batch_price(shared.contexts, context, shared.drafting) if shared is not None else None
        for policy in self.free.values():
            policy.set_price(price)
        sized = self._sized(offer, allowance, context)
        if not sized:
            return NO_DRAFT
        source, k = self._fastest(sized, context) if len(sized) > 1 and self.main.verify_cost.ready else sized[0][:2]
        return DraftPlan(source, k)

    def observe(self, step: StepRecord) -> None:
        self._observe_free(step, self.free.get(step.source, self.main), list(self.free.values()))

    def explain(self) -> str | None:
        return "prompt lookup found no earlier text to copy that was worth drafting"

    def known_regimes(self) -> list[dict[str, Any]]:
        return [r for policy in self.free.values() for r in policy.known_regimes()]

    def describe(self) -> str:
        free = " or ".join(f"{_NAMES[s]} up to {p.k_max}" for s, p in self.free.items())
        return f"LookupLength ({free}, chosen per step from the match)"

    def cost_state(self) -> dict[str, dict[str, Any]]:
        state = self.main.cost_state()
        if self.suffix is not None and self.suffix is not self.main and self.suffix.judged:
            state["suffix_acceptance"] = self.suffix.acceptance_state()
        return state

    def load_cost_state(self, kind: str, state: Mapping[str, Any]) -> None:
        if kind == "suffix_acceptance" and self.suffix is not None and self.suffix is not self.main:
            self.suffix.load_acceptance_state(state)
        else:
            self.main.load_cost_state(kind, state)
