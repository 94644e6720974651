"""The engine's real step loop over scripted contexts (tests/scripted.py): exactness where the draft's
vocabulary differs from the oracle's, non-finite logits, logprobs, and the distribution of what is
sampled against the oracle alone's."""

from __future__ import annotations

import numpy as np
import pytest

from localspec.engine import Engine
from localspec.policy import FixedLength
from localspec.proposers import DraftModelProposer
from localspec.sampling import SamplingParams
from scripted import ScriptedContext, ScriptedModel, hashed_logits, related_logits

ORACLE_VOCAB = 40


def oracle_parts(n_vocab: int = ORACLE_VOCAB, seed: int = 1):
    model = ScriptedModel.sized(n_vocab, "oracle")
    return model, hashed_logits(seed, n_vocab)


def draft_engine(n_draft: int = ORACLE_VOCAB, k: int = 3, *, oracle_logits=None, draft_logits=None) -> Engine:
    """An oracle of ORACLE_VOCAB tokens and a draft model of n_draft tokens (same text for shared ids)
    drafting k tokens per step, as Engine() builds a same-family pair."""
    oracle_model, logits = oracle_parts()
    oracle = ScriptedContext(oracle_model, oracle_logits or logits)
    draft = ScriptedContext(ScriptedModel.sized(n_draft, "draft"),
                            draft_logits or related_logits(logits, ORACLE_VOCAB, 2, n_draft))
    proposer = DraftModelProposer(draft, n_vocab=ORACLE_VOCAB)
    return Engine.from_parts(oracle=oracle, proposer=proposer, policy=FixedLength(k), draft=draft)


MODES = {"greedy": {}, "seeded": {"temperature": 1.0, "seed": 5}, "sampled": {"temperature": 1.0}}


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


# --- a draft whose vocabulary size differs from the oracle's (Qwen2.5-0.5B: 151936, 7B: 152064) ---


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n_draft", [36, 44])
def test_a_draft_of_another_vocabulary_size_drafts_in_every_mode(n_draft, mode):
    engine = draft_engine(n_draft)
    accepted = 0
    for _ in range(3):
        r = engine.generate("the", max_tokens=40, **MODES[mode])
        assert r.stats.drafted > 0 and max(r.tokens) < ORACLE_VOCAB
        accepted += r.stats.accepted
    assert accepted > 0


def test_a_smaller_draft_reads_past_ids_it_does_not_have():
    """The oracle may emit one of its ids the draft lacks (36..39 here): llama_decode would refuse it
    on the draft, which drafts as if it were not in the text."""
    engine = draft_engine(36)
    history = engine.oracle_model.tokenize("the") + [38, 5, 39, 6]
    proposer = engine.proposer
    proposer.prefill(history[:-1])
    draft = proposer.propose(history, 3, SamplingParams(), np.random.default_rng(0))
    readable = [t for t in history if t < 36]
    assert len(draft) == 3 and proposer.ctx.tokens[:len(readable)] == readable


@pytest.mark.parametrize("n_draft", [36, 44])
def test_greedy_and_seeded_output_is_the_oracle_alones(n_draft):
    engine, alone = draft_engine(n_draft), draft_engine(k=0)
    for options in [{}, *({"temperature": 1.0, "seed": seed} for seed in range(6))]:
        assert engine.generate("the", max_tokens=30, **options).tokens == \
            alone.generate("the", max_tokens=30, **options).tokens


@pytest.mark.parametrize("mode", MODES)
def test_a_larger_draft_that_is_the_oracle_on_its_ids_is_always_accepted(mode):
    """The draft's extra ids are masked before it picks, not rejected after: a draft whose logits are
    the oracle's on the 40 shared ids (its 4 extra ids likelier than any) proposes exactly what the
    oracle would, in every mode (seeded mode's noise over the oracle's 40 ids on both sides)."""
    _, logits = oracle_parts()
    engine = draft_engine(44, draft_logits=related_logits(logits, ORACLE_VOCAB, 2, 44, weight=1.0, extra_bias=10.0))
    drafted = 0
    for seed in range(5):
        r = engine.generate("the", max_tokens=40, **{**MODES[mode], "seed": seed} if mode == "seeded" else MODES[mode])
        assert r.stats.accepted == r.stats.drafted
        drafted += r.stats.drafted
    assert drafted > 20
