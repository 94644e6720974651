"""Prompt lookup: drafts copied from earlier in the text, no model (`PromptLookupProposer`), and
what every model-free source (this one, `suffix.SuffixProposer`) does with what it found: cut it
where nothing can follow (`usable`) and draft the plan's share of it (`found_draft`)."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from localspec.outputs import DraftSource
from localspec.speculative.ngram import find_source
from localspec.speculative.plan import NO_OFFER, DraftPlan, Found, Offer
from localspec.speculative.proposers import EMPTY_DRAFT, Draft, ProposeSteps, _Drives
from localspec.speculative.sampling import SamplingParams


class PromptLookupProposer(_Drives):
    """Prompt lookup (n-gram) drafting, no model: find the earlier occurrences of the history's
    last n tokens (longest n first) and propose what followed the one whose text before it agrees
    longest with the history's (the latest on a tie). Pays off when the output copies from the
    input (rewrite, summarise, extract, edit code).

    Each draft says how far back the match goes (`Draft.match_length`: the history's last tokens that
    agree with the ones before the draft's source, n or more, up to `MATCH_CAP`): a copy that has
    held for 30 tokens goes on far more often than a 2-token coincidence, and the length policy sizes
    the draft by it (`policy.LookupLength`, `policy.HybridLength`).

    `min_ngram` defaults to 2: a single repeated token ("the", ",") predicts little, and in the hybrid
    proposer a 1-token match would almost always shut the draft model out.

    `is_end`: the oracle's end-of-generation test. A copy runs on past the end of what it copies
    (a chat prompt goes on with the turn's end and the next turn's header): the draft stops at an
    end-of-generation token, since nothing after one can be emitted (a 64-token verify of a copy's
    last 20 tokens costs twice a 21-token one)."""

    draft_context = None  # no model: nothing to decode

    def __init__(self, *, max_ngram: int = 4, min_ngram: int = 2,
                 is_end: Callable[[int], bool] | None = None) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.is_end = is_end
        # the text as an array, kept from step to step and extended by what was appended since
        self._text: Sequence[int] | None = None  # the history it holds (a request's list, appended to)
        self._tokens = np.zeros(0, dtype=np.int32)  # [capacity] its first _held tokens
        self._held = 0

    def offer(self, history: Sequence[int], limit: int, constraint=None) -> Offer:
        """The tokens that followed the best earlier occurrence of the text's last n-gram (at most
        `limit`, cut at an end of generation and at the first the grammar refuses)."""
        if limit <= 0:
            return NO_OFFER
        tokens = self._as_array(history)  # [n]
        found = find_source(tokens, history if isinstance(history, list) else None,
                            max_ngram=self.max_ngram, min_ngram=self.min_ngram)
        if found is None:
            return NO_OFFER
        follow, held = found
        guess = usable(tokens[follow:follow + limit].copy(), self.is_end, constraint)  # [<= limit]
        return Offer(lookup=Found(guess, held)) if len(guess) else NO_OFFER

    def propose_steps(self, history: Sequence[int], plan: DraftPlan, offer: Offer, sampling: SamplingParams,
                      rng: np.random.Generator, constraint=None) -> ProposeSteps:
        if plan.source != DraftSource.LOOKUP:
            return EMPTY_DRAFT
        return found_draft(offer.lookup, plan, constraint)
        yield  # a proposal that decodes nothing

    def start(self, *, catch_up: bool, pool: str = "", prompt: int | None = None) -> None:
        pass  # nothing to evaluate

    def describe(self) -> str:
        return "lookup"

    def fork(self, seq: int) -> "PromptLookupProposer":
        return PromptLookupProposer(max_ngram=self.max_ngram, min_ngram=self.min_ngram, is_end=self.is_end)

    def _as_array(self, history: Sequence[int]) -> np.ndarray:
        """`history` as an int32 array [n]: what this proposer held of it (the same list, appended to
        since, as the engine keeps a request's) and the tokens after, not the whole text converted
        every step (~25 ns a token: 0.1 ms a step at 4k tokens of context). Another list, a shorter
        one or one whose last held token changed is read anew (a list rewritten further back must
        be another list)."""
        n, held = len(history), self._held
        if history is not self._text or held > n or held and history[held - 1] != self._tokens[held - 1]:
            held = 0  # another text, or this one rewritten
        if n > len(self._tokens):
            grown = np.empty(max(n, 2 * len(self._tokens), 256), dtype=np.int32)
            grown[:held] = self._tokens[:held]
            self._tokens = grown
        if n > held:
            self._tokens[held:n] = history[held:n]
        self._text, self._held = history, n
        return self._tokens[:n]


def usable(tokens: np.ndarray, is_end: Callable[[int], bool] | None, constraint=None) -> np.ndarray:
    """Found `tokens` [n] cut after the first end of generation (nothing after one can be emitted)
    and before the first the grammar refuses; the walk is left as it was."""
    if is_end is not None and len(tokens):
        tokens = tokens[:next((i + 1 for i, t in enumerate(tokens.tolist()) if is_end(t)), len(tokens))]
    if constraint is not None and len(tokens):
        allowed = constraint.extend(tokens.tolist())
        constraint.pop(allowed)
        tokens = tokens[:allowed]
    return tokens


def found_draft(found: Found, plan: DraftPlan, constraint=None) -> Draft:
    """The draft of a model-free source: the first `plan.length` tokens it found (pushed onto the
    grammar walk, which allowed them when they were found)."""
    tokens = found.tokens[:max(0, plan.length)]  # [k]
    if not len(tokens):
        return EMPTY_DRAFT
    if constraint is not None:
        constraint.extend(tokens.tolist())
    return Draft(tokens, None, source=plan.source, match_length=found.match_length,
                 stop="match" if len(tokens) < plan.length else "")
