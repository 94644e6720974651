"""Proposers: where draft tokens come from. Each is a small class behind one `propose` call.

`propose(history, max_len, sampling, rng)` returns a `Draft` of at most `max_len` tokens that would
follow `history` (every token so far, the not-yet-verified last one included). `observe` tells the
proposer how many of its tokens the oracle accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from .llama import ContextFullError, LlamaContext
from .sampling import SamplingParams, logits_to_probs, sample


@dataclass(frozen=True)
class Draft:
    tokens: np.ndarray  # [k] int32
    probs: np.ndarray | None  # [k, vocab] the distributions the tokens were drawn from; None: point masses

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY_DRAFT = Draft(np.zeros(0, dtype=np.int32), None)


class Proposer(Protocol):
    def propose(self, history: Sequence[int], max_len: int, sampling: SamplingParams,
                rng: np.random.Generator) -> Draft: ...

    def observe(self, n_proposed: int, n_accepted: int) -> None: ...


class DraftModelProposer:
    """A small model drafting autoregressively on its own context.

    The draft context's cache is synced lazily: each `propose` reuses the longest prefix it already
    holds and evaluates only what is new (the accepted tokens and the last emitted one), in one batch.

    Greedy decoding drafts the argmax and hands the verifier point masses (probs=None). Sampled
    decoding draws each token from the draft's filtered distribution and hands that distribution on,
    so the acceptance test uses exactly the probabilities the token was drawn from.

    `p_min`: stop drafting once the draft's own top probability falls below it (0 disables).
    """

    def __init__(self, ctx: LlamaContext, *, p_min: float = 0.0) -> None:
        self.ctx = ctx
        self.p_min = p_min
        self.tokens_evaluated = 0  # draft-side tokens decoded, prompt included

    def propose(self, history: Sequence[int], max_len: int, sampling: SamplingParams,
                rng: np.random.Generator) -> Draft:
        max_len = min(max_len, self.ctx.n_ctx - len(history) + 1)
        if max_len <= 0:
            return EMPTY_DRAFT
        try:
            logits, n_eval = self.ctx.sync(history)  # [1, vocab]
        except ContextFullError:
            return EMPTY_DRAFT
        self.tokens_evaluated += n_eval
        tokens: list[int] = []
        probs: list[np.ndarray] = []
        while True:
            token, confident = self._pick(logits[0], sampling, rng, probs)
            tokens.append(token)
            if len(tokens) == max_len or not confident:
                break
            logits = self.ctx.decode([token])
            self.tokens_evaluated += 1
        return Draft(np.asarray(tokens, dtype=np.int32), np.stack(probs) if probs else None)

    def _pick(self, row: np.ndarray, sampling: SamplingParams, rng: np.random.Generator,
              probs: list[np.ndarray]) -> tuple[int, bool]:
        """Choose the next draft token from logits `row` [vocab]; say whether to keep drafting."""
        if sampling.greedy:
            token = int(row.argmax())
            if self.p_min <= 0:
                return token, True
            top = 1.0 / np.exp(row.astype(np.float64) - row[token]).sum()  # softmax at the argmax
            return token, top >= self.p_min
        dist = logits_to_probs(row, sampling)  # [vocab]
        probs.append(dist)
        token = sample(dist, rng)
        return token, self.p_min <= 0 or dist.max() >= self.p_min

    def observe(self, n_proposed: int, n_accepted: int) -> None:
        pass  # the cache is re-synced on the next propose
