"""One speculative step's decision, made before anything runs: a proposer's `Offer` (what it could
draft now, found without decoding), a length policy's `DraftPlan` (which source drafts how many
tokens), which the proposer then carries out. The policy decides, the proposer runs, the engine
verifies; neither of the first two calls the other (vLLM's scheduler output, HF's candidate
generator)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from localspec.outputs import DraftSource


@dataclass(frozen=True)
class Offer:
    """What a proposer can draft this step, known before any decode: the tokens prompt lookup found
    after the text (grammar-checked; empty: none, or no lookup), and whether a draft model can draft."""

    found: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # [n] int32
    match_length: int = 0  # the text's last tokens that agree with the ones before the found tokens' source
    model: bool = False  # a draft model can draft (it is not run to say so)


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
NO_DRAFT = DraftPlan()


def plain_plan(offer: Offer, length: int) -> DraftPlan:
    """The rule without a learning policy: prompt lookup's tokens where it found some (up to
    `length`), else the draft model's `length`."""
    if length <= 0:
        return NO_DRAFT
    if len(offer.found):
        return DraftPlan(DraftSource.LOOKUP, min(length, len(offer.found)))
    return DraftPlan(DraftSource.MODEL, length) if offer.model else NO_DRAFT


def unused_offer(offer: Offer, source: DraftSource, emitted: Sequence[int]) -> tuple[int, int]:
    """(compared, matched): prompt lookup's offer for a step that another source drafted (or none
    did), its first tokens compared with the `emitted` ones and how many agreed in a row; (0, 0)
    when the lookup drafted or offered nothing (see `StepRecord.offer_compared`)."""
    if source == DraftSource.LOOKUP:
        return 0, 0
    compared = min(len(offer.found), len(emitted))
    differs = np.flatnonzero(offer.found[:compared] != np.asarray(emitted[:compared]))  # [<= compared]
    return compared, int(differs[0]) if differs.size else compared
