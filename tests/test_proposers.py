"""Proposer logic on plain token arrays (no model)."""

import numpy as np
import pytest

from localspec.proposers import EMPTY_DRAFT, Draft, HybridProposer, PromptLookupProposer
from localspec.sampling import SamplingParams

GREEDY = SamplingParams()


def lookup(history, max_len=8, **kw):
    return PromptLookupProposer(**kw).propose(history, max_len, GREEDY, np.random.default_rng(0)).tokens.tolist()


def test_ngram_match_proposes_what_followed():
    #            0  1  2  3  4  5  6  7  8
    history = [5, 6, 7, 8, 9, 1, 2, 6, 7]
    assert lookup(history, 3) == [8, 9, 1]


def test_longest_match_wins_over_a_more_recent_shorter_one():
    # suffix [1, 2, 3]: the 3-gram occurs at 0 (followed by 40); "3" alone occurs later at 6 (followed by 50)
    history = [1, 2, 3, 40, 41, 9, 3, 50, 51, 1, 2, 3]
    assert lookup(history, 2) == [40, 41]


def test_most_recent_occurrence_of_the_same_length_wins():
    history = [4, 5, 10, 4, 5, 20, 4, 5]
    assert lookup(history, 1) == [20]


def test_no_match_gives_an_empty_draft():
    assert lookup([1, 2, 3, 4, 5]) == []
    assert lookup([7]) == []
    assert lookup([]) == []


def test_continuation_is_capped_by_max_len_and_history_end():
    history = [1, 2, 3, 1, 2]
    assert lookup(history, 10) == [3, 1, 2]
    assert lookup(history, 1) == [3]
    assert lookup(history, 0) == []


def test_min_ngram_refuses_short_matches():
    history = [9, 1, 8, 3, 1]  # only the 1-gram "1" matches
    assert lookup(history, 2) == []  # the default needs 2 tokens
    assert lookup(history, 2, min_ngram=2) == []
    assert lookup(history, 2, min_ngram=1) == [8, 3]


def test_lookup_drafts_are_point_masses():
    d = PromptLookupProposer().propose([1, 2, 3, 1, 2], 4, GREEDY, np.random.default_rng(0))
    assert d.tokens.tolist() == [3, 1, 2] and d.probs is None and d.tokens.dtype == np.int32


def test_bad_ngram_bounds():
    with pytest.raises(ValueError):
        PromptLookupProposer(max_ngram=1, min_ngram=2)


class CountingModel:
    def __init__(self):
        self.calls = 0

    def propose(self, history, max_len, sampling, rng):
        self.calls += 1
        return Draft(np.array([99] * max_len, dtype=np.int32), None)

    def start(self, *, catch_up):
        self.catch_up = catch_up


def test_hybrid_uses_lookup_when_it_matches_and_the_model_otherwise():
    model = CountingModel()
    hybrid = HybridProposer(PromptLookupProposer(), model)
    rng = np.random.default_rng(0)
    assert hybrid.propose([1, 2, 3, 1, 2], 2, GREEDY, rng).tokens.tolist() == [3, 1]
    assert model.calls == 0
    assert hybrid.propose([1, 2, 3, 4], 2, GREEDY, rng).tokens.tolist() == [99, 99]
    assert model.calls == 1
    assert hybrid.propose([1, 2, 3, 4, 2], 2, GREEDY, rng).tokens.tolist() == [99, 99]  # "2" alone: the model
    assert model.calls == 2


def test_empty_draft_constant():
    assert len(EMPTY_DRAFT) == 0 and EMPTY_DRAFT.probs is None
