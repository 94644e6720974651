"""One speculative step's decision, made before anything runs: a proposer's `Offer` (what it could
draft now, found without decoding: prompt lookup's and the suffix cache's tokens, a draft model), a length policy's `DraftPlan` (which source drafts how many
tokens), which the proposer then carries out. The policy decides, the proposer runs, the engine
verifies; neither of the first two calls the other (vLLM's scheduler output, HF's candidate
generator)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from localspec.outputs import DraftSource, OfferScore


@dataclass(frozen=True)
class Found:
    """Tokens a model-free source found after the text (grammar-checked), and the match they follow:
    the text's last tokens that agree with the ones before the found tokens' source."""

    tokens: np.ndarray  # [n] int32
    match_length: int = 0


NOTHING = Found(np.zeros(0, dtype=np.int32))


@dataclass(frozen=True)
class Offer:
    """What a proposer can draft this step, known before any decode: what prompt lookup found in
    the request's own text, what the suffix cache found in earlier requests', and whether a draft
    model can draft (it is not run to say so)."""

    lookup: Found = NOTHING
    suffix: Found = NOTHING
    model: bool = False

    @property
    def found_nothing(self) -> bool:
        """Whether no model-free source found tokens (most steps), known without building `found()`."""
        return self.lookup is NOTHING and self.suffix is NOTHING

    def found(self) -> list[tuple[DraftSource, Found]]:
        """The model-free sources that found tokens, prompt lookup first."""
        return [(source, found) for source, found in ((DraftSource.LOOKUP, self.lookup),
                                                      (DraftSource.SUFFIX, self.suffix)) if len(found.tokens)]


@dataclass(frozen=True)
class DraftPlan:
    """Which source drafts this step, and at most how many tokens (a draft model may stop sooner)."""

    source: DraftSource = DraftSource.NONE
    length: int = 0
    resync: bool = False  # the draft model first conditions on all of the text again (a re-try)
    probe: bool = False  # a short draft for evidence while drafting does not pay (a window of the text will do)

    @property
    def drafts(self) -> bool:
        return self.length > 0 and self.source != DraftSource.NONE


@dataclass(frozen=True)
class SharedPass:
    """The verify pass a step shares with other sequences, as a policy prices a draft in it."""

    contexts: Sequence[int]  # the context of every running sequence the pass carries (this one's too)
    drafting: float  # how many of them lately drafted with the model (they share its rounds)


NO_OFFER = Offer()
MODEL_ONLY = Offer(model=True)  # a draft model's offer where no model-free source found tokens
NO_DRAFT = DraftPlan()


def plain_plan(offer: Offer, length: int) -> DraftPlan:
    """The rule without a learning policy: the tokens a model-free source found (prompt lookup's
    first), up to `length`, else the draft model's `length`."""
    if length <= 0:
        return NO_DRAFT
    for source, found in offer.found():
        return DraftPlan(source, min(length, len(found.tokens)))
    return DraftPlan(DraftSource.MODEL, length) if offer.model else NO_DRAFT


def unused_offers(offer: Offer, source: DraftSource, emitted: Sequence[int]) -> tuple[OfferScore, ...]:
    """Each model-free source's offer that the step did not draft (another source did, or none),
    its first tokens compared with the `emitted` ones (see `StepRecord.unused`)."""
    if offer.found_nothing:  # most steps
        return ()
    scores = []
    for offered, found in offer.found():
        if offered != source:
            compared = min(len(found.tokens), len(emitted))
            differs = np.flatnonzero(found.tokens[:compared] != np.asarray(emitted[:compared]))  # [<= compared]
            matched = int(differs[0]) if differs.size else compared
            scores.append(OfferScore(offered, compared, matched, found.match_length))
    return tuple(scores)


def all_or_none(plans: Sequence[DraftPlan]) -> list[DraftPlan]:
    """The plans of a batch that runs until its longest answer ends (nobody waits for a slot):
    a draft that speeds one sequence up and slows the pass for all of them shortens nothing unless
    every sequence drafts, so every plan drafts, or none does (a re-try's resync is kept)."""
    if all(plan.drafts for plan in plans):
        return list(plans)
    return [DraftPlan(resync=plan.resync) for plan in plans]
