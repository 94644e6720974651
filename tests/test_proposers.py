"""Proposer logic on plain token arrays and scripted draft contexts (no model)."""

import numpy as np
import pytest

from localspec.runtime.factory import lookup_policy
from localspec.outputs import DraftSource
from localspec.speculative.plan import DraftPlan, Found, Offer, unused_offers
from localspec.speculative.ngram import MATCH_CAP
from localspec.speculative.lookup import PromptLookupProposer
from localspec.speculative.proposers import EMPTY_DRAFT, MODEL_OFFER, Draft, DraftModelProposer, HybridProposer, drive
from localspec.speculative.proposal import PROPOSAL_TAIL_NATS
from localspec.speculative.sampling import SamplingParams, logits_to_probs
from scripted import ScriptedContext, ScriptedModel, hashed_logits, related_logits

GREEDY = SamplingParams()


def lookup(history, max_len=8, **kw):
    return PromptLookupProposer(**kw).propose(history, max_len, GREEDY, np.random.default_rng(0)).tokens.tolist()


def test_ngram_match_proposes_what_followed():
    #            0  1  2  3  4  5  6  7  8
    history = [5, 6, 7, 8, 9, 1, 2, 6, 7]
    assert lookup(history, 3) == [8, 9, 1]


def _lookup_by_brute_force(history, max_len, max_ngram=4, min_ngram=2):
    """What prompt lookup should propose, spelled out: the longest n whose last-n tokens occurred
    before, the occurrence whose preceding text agrees longest (latest on a tie, among the latest
    SOURCES_COMPARED), what followed it. A source's agreement: how many of the history's last tokens
    equal the ones before it, read backwards, up to MATCH_CAP."""
    from localspec.speculative.ngram import SOURCES_COMPARED

    def agreement(follow):
        span = min(follow, MATCH_CAP)
        return next((i for i in range(span) if history[follow - 1 - i] != history[-1 - i]), span)

    for n in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
        follows = [s + n for s in range(len(history) - n) if history[s:s + n] == history[-n:]]
        if follows:
            follows = follows[-SOURCES_COMPARED:]
            held = [agreement(f) for f in follows]
            best = max(range(len(follows)), key=lambda i: (held[i], i))
            return history[follows[best]:follows[best] + max_len], held[best]
    return [], 0


def test_the_lookup_finds_what_a_search_of_every_earlier_window_finds():
    rng = np.random.default_rng(7)
    for _ in range(400):
        history = rng.integers(0, int(rng.integers(2, 9)), int(rng.integers(0, 120))).tolist()
        max_len = int(rng.integers(1, 12))
        draft = PromptLookupProposer().propose(history, max_len, GREEDY, np.random.default_rng(0))
        tokens, held = _lookup_by_brute_force(history, max_len)
        assert draft.tokens.tolist() == tokens and (draft.match_length == held or not tokens)


def test_a_lookup_kept_from_step_to_step_finds_what_a_fresh_one_finds():
    """One proposer asked every step of a growing text (a request's history, appended to) keeps the
    text as an array and extends it; a text whose last token changed, another list or a shorter one
    is read anew.
    Each offer is the one a fresh proposer makes of the same text."""
    rng = np.random.default_rng(3)
    kept = PromptLookupProposer().fork(0)
    for _ in range(30):
        history = rng.integers(0, 5, int(rng.integers(1, 20))).tolist()
        for _ in range(int(rng.integers(1, 40))):
            offer, fresh = kept.offer(history, 6), PromptLookupProposer().offer(history, 6)
            assert offer.found() == [] if fresh.lookup is None else (
                offer.lookup.tokens.tolist() == fresh.lookup.tokens.tolist()
                and offer.lookup.match_length == fresh.lookup.match_length)
            change = rng.random()
            if change < 0.1 and len(history) > 2:
                history[-1] = (history[-1] + 1) % 5  # its last token taken back and another put there
            elif change < 0.15:
                history = list(history[:len(history) // 2])  # another, shorter list
            else:
                history += rng.integers(0, 5, int(rng.integers(1, 4))).tolist()
    assert PromptLookupProposer().fork(1) is not PromptLookupProposer().fork(1)


def test_the_lookups_plain_python_and_numpy_searches_agree():
    """find_source narrows and ranks a few occurrences in plain Python over the token list, many in
    numpy: both give the same source and match length, on texts with few and with many repeats."""
    from localspec.speculative.ngram import find_source

    rng = np.random.default_rng(9)
    for _ in range(500):
        history = rng.integers(0, int(rng.integers(2, 40)), int(rng.integers(0, 300))).tolist()
        tokens = np.asarray(history, dtype=np.int32)
        for max_ngram, min_ngram in ((4, 2), (3, 1), (6, 3)):
            assert (find_source(tokens, history, max_ngram=max_ngram, min_ngram=min_ngram)
                    == find_source(tokens, None, max_ngram=max_ngram, min_ngram=min_ngram))


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


def test_a_copy_stops_at_the_end_of_generation_token():
    # a chat prompt: the copied text, its turn's end (0), the next turn's header (7, 8); the answer copies
    history = [3, 4, 5, 6, 0, 7, 8, 3, 4]
    assert lookup(history, 8, is_end=lambda t: t == 0) == [5, 6, 0]  # nothing after the end can be emitted
    assert lookup(history, 8) == [5, 6, 0, 7, 8, 3, 4]
    assert lookup(history, 2, is_end=lambda t: t == 0) == [5, 6]


def test_lookup_drafts_are_point_masses():
    d = PromptLookupProposer().propose([1, 2, 3, 1, 2], 4, GREEDY, np.random.default_rng(0))
    assert d.tokens.tolist() == [3, 1, 2] and d.probs is None and d.tokens.dtype == np.int32


def test_bad_ngram_bounds():
    with pytest.raises(ValueError):
        PromptLookupProposer(max_ngram=1, min_ngram=2)


def test_a_lookup_draft_says_how_far_back_its_match_goes():
    #           the source: 5 6 7 8 9 ...          the text's end: 3 7 8
    history = [5, 6, 7, 8, 9, 1, 2, 3, 7, 8]
    d = PromptLookupProposer().propose(history, 4, GREEDY, np.random.default_rng(0))
    assert d.tokens.tolist() == [9, 1, 2, 3] and d.match_length == 2  # "7 8": then 6 against 3
    copy = list(range(100, 140))
    d = PromptLookupProposer().propose(copy + [0] + copy[:30], 64, GREEDY, np.random.default_rng(0))
    assert d.tokens.tolist() == copy[30:] + [0] + copy[:30] and d.match_length == 30  # the whole copy so far
    d = PromptLookupProposer().propose(copy * 3, 4, GREEDY, np.random.default_rng(0))
    assert d.match_length == MATCH_CAP  # measured back so far only


def test_a_lookup_draws_from_the_occurrence_that_agrees_longest():
    #          earlier: 1 2 3 4 -> 5        later: 9 9 3 4 -> 6      the text's end: 1 2 3 4
    history = [1, 2, 3, 4, 5, 0, 9, 9, 3, 4, 6, 0, 1, 2, 3, 4]
    d = PromptLookupProposer(max_ngram=2).propose(history, 2, GREEDY, np.random.default_rng(0))
    assert d.tokens.tolist() == [5, 0] and d.match_length == 4  # not the latest "3 4" (then 6)
    tie = [7, 3, 4, 5, 8, 3, 4, 6, 9, 3, 4]  # both "3 4" agree for 2 tokens only: the latest
    assert PromptLookupProposer(max_ngram=2).propose(tie, 1, GREEDY, np.random.default_rng(0)).tokens.tolist() == [6]


def test_prompt_lookup_alone_sizes_each_draft_by_its_match():
    """`--draft ngram`: the adaptive policy sizes a draft by the match the lookup found
    (`LookupLength`): a 2-token coincidence short, a copy that has held for 40 tokens long; the
    proposer then drafts what the plan says."""
    proposer = PromptLookupProposer()
    policy = lookup_policy()
    adaptive = policy.lookup
    for _ in range(3):
        for n in (1, 8, 32, 64):
            adaptive.verify_cost.observe(n, 100, 0.020 + 0.002 * (n - 1))
    adaptive.est.fresh_trials = adaptive.min_trials
    source = list(range(100, 200))
    rng = np.random.default_rng(0)
    coincidence = source + [7, 150, 151]  # "150 151" occurs in the source, by chance
    copying = source + [7] + source[:40]
    fresh_offer, held_offer = proposer.offer(coincidence, 64), proposer.offer(copying, 64)
    fresh, held = policy.plan(fresh_offer, 64, 100), policy.plan(held_offer, 64, 100)
    assert fresh_offer.lookup.match_length == 2 and 1 <= fresh.length <= 8
    assert held_offer.lookup.match_length == 40 and held.length >= 32
    draft = drive(proposer.propose_steps(copying, held, held_offer, GREEDY, rng), None)
    assert draft.tokens.tolist() == held_offer.lookup.tokens[:held.length].tolist() and draft.source == "lookup"
    assert len(proposer.propose(coincidence, 64, GREEDY, rng)) == 51  # the plain plan: all it found


class CountingModel:
    draft_context = None

    def __init__(self):
        self.calls = 0
        self.resyncs = 0

    def offer(self, history, limit, constraint=None):
        return MODEL_OFFER

    def propose_steps(self, history, plan, offer, sampling, rng, constraint=None):
        if plan.resync:
            self.resync()
        if plan.source != "model" or plan.length <= 0:
            return EMPTY_DRAFT
        self.calls += 1
        return Draft(np.array([99] * plan.length, dtype=np.int32), None)
        yield  # a model that needs no decode

    def start(self, *, catch_up, pool="", prompt=None):
        self.catch_up = catch_up

    def resync(self):
        self.resyncs += 1


def test_hybrid_uses_lookup_when_it_matches_and_the_model_otherwise():
    model = CountingModel()
    hybrid = HybridProposer(PromptLookupProposer(), model)
    rng = np.random.default_rng(0)
    assert hybrid.propose([1, 2, 3, 1, 2], 2, GREEDY, rng).tokens.tolist() == [3, 1]
    assert model.calls == 0
    assert hybrid.propose([1, 2, 3, 4], 2, GREEDY, rng).tokens.tolist() == [99, 99]
    assert model.calls == 1 and model.resyncs == 1  # back from the lookup: it catches up on all the text
    assert hybrid.propose([1, 2, 3, 4, 2], 2, GREEDY, rng).tokens.tolist() == [99, 99]  # "2" alone: the model
    assert model.calls == 2 and model.resyncs == 1


def test_a_hybrid_carries_out_the_plan_it_is_given():
    """The plan says which source drafts, whatever the lookup found; a re-try's resync reaches the
    model even on a step the lookup drafts; a probe after lookup drafts does not catch up."""
    model = CountingModel()
    hybrid = HybridProposer(PromptLookupProposer(), model)
    rng = np.random.default_rng(0)
    text = [1, 2, 3, 1, 2]
    offer = hybrid.offer(text, 4)
    assert offer.lookup.tokens.tolist() == [3, 1, 2] and offer.model and offer.lookup.match_length == 2

    def run(plan):
        return drive(hybrid.propose_steps(text, plan, offer, GREEDY, rng), None)

    assert run(DraftPlan(DraftSource.MODEL, 3)).tokens.tolist() == [99, 99, 99]  # found tokens, the model's turn
    assert run(DraftPlan(DraftSource.LOOKUP, 1, resync=True)).tokens.tolist() == [3] and model.resyncs == 1
    assert run(DraftPlan(DraftSource.MODEL, 2, probe=True)).tokens.tolist() == [99, 99] and model.resyncs == 1
    assert len(run(DraftPlan())) == 0 and model.calls == 2


def test_an_unused_lookup_offer_is_scored_against_what_the_step_emitted():
    offer = PromptLookupProposer().offer([1, 2, 3, 4, 5, 1, 2], 5)  # offers [3, 4, 5, 1, 2]
    assert offer.lookup.tokens.tolist() == [3, 4, 5, 1, 2]
    lookup = DraftSource.LOOKUP
    assert unused_offers(offer, DraftSource.MODEL, [3, 4, 7]) == ((lookup, 3, 2, 2),)  # two agreed, not the third
    assert unused_offers(offer, DraftSource.NONE, [3, 4, 5, 1, 2, 6]) == ((lookup, 5, 5, 2),)  # a plain step
    assert unused_offers(offer, lookup, [3, 4, 7]) == ()  # drafted: judged as a draft
    assert unused_offers(MODEL_OFFER, DraftSource.MODEL, [3]) == ()  # nothing offered
    both = Offer(lookup=offer.lookup, suffix=Found(np.array([3, 9], dtype=np.int32), 7))
    assert unused_offers(both, DraftSource.SUFFIX, [3, 4]) == ((lookup, 2, 2, 2),)  # the suffix's is a draft's
    assert unused_offers(both, lookup, [3, 4]) == ((DraftSource.SUFFIX, 2, 1, 7),)


def test_a_lookup_offer_leaves_a_grammar_walk_as_it_was():
    class Walk:  # a grammar that allows every token but 5, and counts what is on it
        depth = 0

        def extend(self, tokens):
            n = next((i for i, t in enumerate(tokens) if t == 5), len(tokens))
            self.depth += n
            return n

        def pop(self, n):
            self.depth -= n

    walk = Walk()
    offer = PromptLookupProposer().offer([1, 2, 3, 4, 5, 1, 2], 5, walk)
    assert offer.lookup.tokens.tolist() == [3, 4] and walk.depth == 0  # cut where the grammar refuses, nothing pushed
    draft = drive(PromptLookupProposer().propose_steps([1, 2, 3, 4, 5, 1, 2], DraftPlan(DraftSource.LOOKUP, 2), offer,
                                                       GREEDY, None, walk), None)
    assert draft.tokens.tolist() == [3, 4] and walk.depth == 2  # the draft's tokens pushed, as a model's are


def test_empty_draft_constant():
    assert len(EMPTY_DRAFT) == 0 and EMPTY_DRAFT.probs is None


# --- a draft model whose vocabulary size differs from the oracle's -------------------------------


def oracle_sized(row: np.ndarray, n_oracle: int) -> np.ndarray:
    """The reference: a draft's logits row cut to the oracle's size, or padded with -inf."""
    out = np.full(n_oracle, -np.inf, dtype=row.dtype)
    n = min(row.size, n_oracle)
    out[:n] = row[:n]
    return out


def without_far_tail(row: np.ndarray, sampling: SamplingParams) -> np.ndarray:
    """The reference of a sampled draft's distribution: the request's, over the tokens whose logits
    lie within (log(vocab) + PROPOSAL_TAIL_NATS) * temperature of the top (the rest masked), unless
    those are more than half the row (then the whole of it)."""
    near = row >= row.max() - (np.log(row.size) + PROPOSAL_TAIL_NATS) * sampling.temperature
    return logits_to_probs(np.where(near, row, -np.inf) if 2 * near.sum() <= row.size else row, sampling)


@pytest.mark.parametrize("n_draft", [36, 40, 44])
@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=4),
                                      SamplingParams(temperature=0.8, top_k=5)], ids=["greedy", "sampled", "seeded", "top-k"])
def test_draft_model_drafts_over_the_oracles_vocabulary(n_draft, sampling):
    """Ids the oracle lacks (44 > 40) are masked before the draft picks; ids the draft lacks (36 < 40)
    get probability 0; the draft's distributions are over the oracle's 40 ids, in every mode."""
    n_oracle = 40
    model = ScriptedModel.sized(n_draft)
    logits = related_logits(hashed_logits(1, n_oracle), n_oracle, 2, n_draft, extra_bias=3.0)  # extra ids likely
    ctx = ScriptedContext(model, logits)
    proposer = DraftModelProposer(ctx, n_vocab=n_oracle)
    history = model.tokenize("the")
    picked_extra = False
    for seed in range(20):
        ctx.reset()
        draft = proposer.propose(history, 4, sampling, np.random.default_rng(seed))
        tokens = draft.tokens.tolist()
        k = len(tokens)  # 4, or fewer when the draft proposed its EOS
        assert (k == 4 or tokens[-1] == model.eos) and max(tokens) < n_oracle
        rows = [oracle_sized(logits(tuple(history + tokens[:i])), n_oracle) for i in range(k)]  # [k] x [40]
        if sampling.greedy:
            assert tokens == [int(np.argmax(r)) for r in rows] and draft.probs is None
        elif sampling.coupled:
            assert draft.probs is None  # the oracle checks its own seeded pick
        else:
            assert draft.probs.shape == (k, n_oracle)
            np.testing.assert_allclose(draft.probs, np.stack([without_far_tail(r, sampling) for r in rows]), rtol=1e-6)
        picked_extra |= any(int(np.argmax(logits(tuple(history + tokens[:i])))) >= n_oracle for i in range(k))
    assert picked_extra == (n_draft > n_oracle)  # unmasked, the larger draft would have proposed them
