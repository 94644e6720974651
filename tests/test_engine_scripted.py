"""The engine's real step loop over scripted contexts (tests/scripted.py): exactness where the draft's
vocabulary differs from the oracle's, non-finite logits, logprobs, and the distribution of what is
sampled against the oracle alone's."""

from __future__ import annotations

import numpy as np
import pytest

from localspec.engine import Engine
from localspec.policy import FixedLength
from localspec.proposers import DraftModelProposer
from scripted import ScriptedContext, ScriptedModel, hashed_logits, related_logits

ORACLE_VOCAB = 40


def oracle_parts(n_vocab: int = ORACLE_VOCAB, seed: int = 1):
    model = ScriptedModel.sized(n_vocab, "oracle")
    return model, hashed_logits(seed, n_vocab)


def draft_engine(n_draft: int = ORACLE_VOCAB, k: int = 3, *, oracle_logits=None, draft_logits=None) -> Engine:
    """An oracle of ORACLE_VOCAB tokens and a draft model of n_draft tokens (same text for shared ids)
    drafting k tokens per step."""
    oracle_model, logits = oracle_parts()
    oracle = ScriptedContext(oracle_model, oracle_logits or logits)
    draft = ScriptedContext(ScriptedModel.sized(n_draft, "draft"),
                            draft_logits or related_logits(logits, ORACLE_VOCAB, 2, n_draft))
    return Engine.from_parts(oracle=oracle, proposer=DraftModelProposer(draft), policy=FixedLength(k), draft=draft)


# --- non-finite logits -----------------------------------------------------------------------------


def nan_after(logits, n: int):
    """`logits`, but a row with a NaN once the history is n tokens long."""
    def at(history):
        row = logits(history)
        if len(history) >= n:
            row = row.copy()
            row[7] = np.nan
        return row
    return at


@pytest.mark.parametrize("options", [{}, {"temperature": 0.8}, {"temperature": 0.8, "seed": 1}],
                         ids=["greedy", "sampled", "seeded"])
@pytest.mark.parametrize("where", ["oracle", "draft", "oracle alone"])
def test_nan_logits_raise_in_every_mode(options, where):
    """A NaN logit is a broken model, whatever the mode: greedy raises the sampled paths' error
    instead of emitting the NaN's index (numpy's argmax returns it)."""
    _, logits = oracle_parts()
    if where == "draft":
        engine = draft_engine(draft_logits=nan_after(related_logits(logits, ORACLE_VOCAB, 2, ORACLE_VOCAB), 6))
    else:
        engine = draft_engine(k=0 if where == "oracle alone" else 3, oracle_logits=nan_after(logits, 6))
    with pytest.raises(ValueError, match="finite maximum"):
        engine.generate("the", max_tokens=12, **options)
