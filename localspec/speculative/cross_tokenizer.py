"""A draft model with another vocabulary than the oracle's: its proposals go through text
(HF transformers' "universal assisted generation"). The oracle verifies every token, so the output
is exactly the oracle's; see `CrossTokenizerProposer`."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from localspec.outputs import DraftSource
from localspec.speculative.plan import NO_OFFER, DraftPlan, Offer
from localspec.speculative.proposers import (EMPTY_DRAFT, MODEL_OFFER, Draft, DraftModelProposer, ProposeSteps,
                                             _Wrapper)
from localspec.speculative.sampling import SamplingParams


class CrossTokenizerProposer(_Wrapper):
    """A draft model with a different vocabulary (HF transformers' "universal assisted generation").

    The oracle's history is turned into text and re-tokenized for the draft; the draft's tokens are
    turned into text and re-tokenized for the oracle. The oracle still verifies every token, so
    greedy output is exactly the oracle's. The drafted oracle tokens are not samples from a
    distribution over the oracle's vocabulary, so they are verified as point masses (probs=None):
    accept d with probability target_probs[d], else sample from target_probs with d removed. That
    keeps sampled output exactly the oracle's distribution too; it only accepts less often than
    same-vocabulary speculative sampling would.
    """

    def __init__(self, inner: DraftModelProposer, *, oracle, draft) -> None:
        self.inner = self.drafter = inner
        self.oracle = oracle  # LlamaModel
        self.draft = draft  # LlamaModel
        self._pieces: list[bytes] = []  # oracle-side bytes per history token, reused across steps
        self._history: list[int] = []

    def fork(self, seq: int) -> "CrossTokenizerProposer":
        return CrossTokenizerProposer(self.inner.fork(seq), oracle=self.oracle, draft=self.draft)

    def start(self, *, catch_up: bool, pool: str = "", prompt: int | None = None) -> None:
        self.inner.start(catch_up=catch_up, pool=pool)  # the prompt's length in the draft's tokens is not known

    def offer(self, history: Sequence[int], limit: int, constraint=None) -> Offer:
        return MODEL_OFFER

    def _text(self, history: Sequence[int]) -> str:
        n = 0
        limit = min(len(self._history), len(history))
        while n < limit and self._history[n] == history[n]:
            n += 1
        del self._history[n:], self._pieces[n:]
        for token in history[n:]:
            self._history.append(token)
            self._pieces.append(self.oracle.token_piece(token, special=True))
        return b"".join(self._pieces).decode("utf-8", errors="ignore")

    def propose_steps(self, history: Sequence[int], plan: DraftPlan, offer: Offer, sampling: SamplingParams,
                      rng: np.random.Generator, constraint=None) -> ProposeSteps:
        """Under a grammar the draft model drafts freely (its ids are not the oracle's) and the
        re-tokenized draft is cut at the first token the grammar refuses."""
        if plan.resync:
            self.inner.resync()
        if plan.source != DraftSource.MODEL or plan.length <= 0:
            return EMPTY_DRAFT
        max_len = plan.length
        draft_history = self.draft.tokenize(self._text(history), add_special=True, parse_special=True)
        proposal = yield from self.inner.propose_steps(draft_history, plan, NO_OFFER, sampling, rng)
        if not len(proposal):
            return EMPTY_DRAFT
        text = self.draft.detokenize(proposal.tokens.tolist())
        tokens = self.oracle.tokenize(text, add_special=False, parse_special=False)[:max_len]
        stop = proposal.stop
        if constraint is not None:
            allowed = constraint.extend(tokens)
            stop, tokens = "grammar" if allowed < len(tokens) else stop, tokens[:allowed]
        return Draft(np.asarray(tokens, dtype=np.int32), None, proposal.evaluated, proposal.prompt_time, stop=stop)

    def describe(self) -> str:
        return "cross-tokenizer"
