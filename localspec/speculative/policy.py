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
processes (`Learning`). What is learned: `estimates`; one source's length: `lengths`. The reasoning
and the measured figures: docs/policy.md.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from localspec.outputs import DraftSource, StepRecord
from localspec.speculative.costs import fit_line
from localspec.speculative.estimates import (ACCEPTANCE_LAYOUT, GREEDY, LOOKUP_PRIORS, LOOKUP_RUNS, MAX_RETRY_WAIT,
                                             TEMPERATURE_EDGES, AcceptanceByPlace, BatchPrice, Estimates, Learned,
                                             Regime)
from localspec.speculative.lengths import AdaptiveLength, FixedLength, Outlook
from localspec.speculative.plan import NO_DRAFT, DraftPlan, Offer, SharedPass

__all__ = ["ACCEPTANCE_LAYOUT", "GREEDY", "LOOKUP_PRIORS", "LOOKUP_RUNS", "MAX_RETRY_WAIT", "TEMPERATURE_EDGES",
           "AcceptanceByPlace", "AdaptiveLength", "BatchPrice", "Estimates", "FixedLength", "HybridLength",
           "Learned", "Learning", "LengthPolicy", "LookupLength", "Outlook", "Regime", "fit_line", "learns"]


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
        "draft", "acceptance"; the engine keys each by what it depends on); empty: nothing. A
        snapshot: new containers the policy never changes after (another thread writes them)."""

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
        source, k, _ = max(candidates, key=lambda c: c[2].outlook.rates(c[1], context)[c[1]])
        return source, k

    def _observe_free(self, step: StepRecord, used: AdaptiveLength, others: Sequence[AdaptiveLength]) -> None:
        """The step's record to the policy of the source that drafted it; the others' next first
        token is a fresh one; the unused offers scored."""
        used.observe(step)
        if step.drafted:
            for policy in others:
                if policy is not used:
                    policy.outlook.run = 0  # its next first token is a fresh one
        for score in step.unused:
            policy = self.free.get(score.source)
            if policy is not None:
                policy.outlook.score_unverified(score.matched, score.compared, run=score.run)

    def _free_state(self) -> dict[str, dict[str, Any]]:
        kept = {source: policy.cost_state().get("acceptance") for source, policy in self.free.items()}
        return {f"{source}_acceptance": state for source, state in kept.items() if state is not None}

    def _load_free_state(self, kind: str, state: Mapping[str, Any]) -> bool:
        source = kind.removesuffix("_acceptance")
        if kind.endswith("_acceptance") and source in self.free:
            self.free[DraftSource(source)].load_cost_state("acceptance", state)
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
        self._free_k_max = max((p.outlook.k_max for p in self.free.values()), default=0)

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
        price = self.model.learned.batch_price(shared.contexts, context, shared.drafting) if shared is not None else None
        for policy in (self.model, *self.free.values()):
            policy.outlook.price = price
        k_model = self.model.draft_length(limit, context) if limit > 0 else 0
        resync = limit > 0 and self.model.outlook.take_resync()
        allowance = min(limit, max(k_model, self._free_k_max))
        source, k = self._choose(offer, allowance, k_model, context)
        if k <= 0 or source == DraftSource.MODEL and not offer.model:
            return DraftPlan(resync=True) if resync else NO_DRAFT
        return DraftPlan(source, k, resync=resync, probe=source == DraftSource.MODEL and self.model.probing)

    def _choose(self, offer: Offer, allowance: int, k_model: int, context: int) -> tuple[DraftSource, int]:
        """(source, length) for a step, within `allowance`."""
        if offer.found_nothing:  # (most steps: only the model's)
            return DraftSource.MODEL, k_model
        sized = self._sized(offer, allowance, context)
        if not sized:
            return DraftSource.MODEL, k_model
        if not self.model.verify_cost.ready:
            return sized[0][:2]  # nothing measured yet: the free draft first
        if k_model > 0 and self.model.for_evidence:
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
        free = " or ".join(f"{_NAMES[s]} up to {p.outlook.k_max}" for s, p in self.free.items())
        return f"HybridLength ({free} or the draft model up to {self.model.outlook.k_max}, chosen per step)"

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
        allowance = min(limit, max(p.outlook.k_max for p in self.free.values()))
        if not offer.found() or allowance <= 0:
            return NO_DRAFT
        price = self.main.learned.batch_price(shared.contexts, context, shared.drafting) if shared is not None else None
        for policy in self.free.values():
            policy.outlook.price = price
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
        free = " or ".join(f"{_NAMES[s]} up to {p.outlook.k_max}" for s, p in self.free.items())
        return f"LookupLength ({free}, chosen per step from the match)"

    def cost_state(self) -> dict[str, dict[str, Any]]:
        state = self.main.cost_state()
        if self.suffix is not None and self.suffix is not self.main:
            kept = self.suffix.cost_state().get("acceptance")
            if kept is not None:
                state["suffix_acceptance"] = kept
        return state

    def load_cost_state(self, kind: str, state: Mapping[str, Any]) -> None:
        if kind == "suffix_acceptance" and self.suffix is not None and self.suffix is not self.main:
            self.suffix.load_cost_state("acceptance", state)
        else:
            self.main.load_cost_state(kind, state)
