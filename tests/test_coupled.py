"""Seeded (coupled) sampling: exact draws from the oracle, independent of the draft."""

import numpy as np
import pytest

from localspec.speculative.acceptance import accept, accept_greedy
from localspec.speculative.sampling import (NOISE_CACHE_BYTES, SamplingParams, coupled_choice, gumbel_noise, logits_to_probs,
                                seed_key)


def tv(counts, probs):
    return 0.5 * np.abs(counts / counts.sum() - probs).sum()


def test_coupled_choice_is_an_exact_draw():
    probs = np.array([0.5, 0.25, 0.125, 0.0, 0.125])
    def distance(n):
        counts = np.bincount([coupled_choice(probs, seed, 7) for seed in range(n)], minlength=5)
        assert counts[3] == 0  # a zero-probability token is never drawn
        return tv(counts, probs)
    small, large = distance(500), distance(20000)
    assert large < 0.02 and large < small


def test_noise_is_keyed_by_seed_and_position():
    a = gumbel_noise(1, 5, 100)
    assert np.array_equal(a, gumbel_noise(1, 5, 100))
    assert not np.array_equal(a, gumbel_noise(1, 6, 100))
    assert not np.array_equal(a, gumbel_noise(2, 5, 100))
    assert not a.flags.writeable


def test_seeded_params_are_coupled_greedy_and_unseeded_are_not():
    assert SamplingParams(temperature=0.7, seed=3).coupled
    assert not SamplingParams(temperature=0.7).coupled
    assert not SamplingParams(temperature=0.0, seed=3).coupled


def markov_logits(rng, vocab):
    return rng.normal(size=(vocab, vocab)).astype(np.float32) * 2  # next-token logits given the previous token


def run(target, draft, sampling, k, n_tokens, start=0):
    """A toy speculative loop over Markov tables with the engine's own acceptance step."""
    seq = [start]
    while len(seq) - 1 < n_tokens:
        pos = len(seq)
        proposal = []
        prev = seq[-1]
        for i in range(k):
            q = logits_to_probs(draft[prev], sampling)
            prev = coupled_choice(q, sampling.seed, pos + i)
            proposal.append(prev)
        ctx = [seq[-1]] + proposal
        logits = np.stack([target[t] for t in ctx])  # [k+1, vocab]
        out, n = accept(np.array(proposal, dtype=np.int32), None, logits, sampling, np.random.default_rng(0),
                        position=pos)
        assert len(out) == n + 1
        seq.extend(out.tolist())
    return seq[1:n_tokens + 1]


@pytest.mark.parametrize("filters", [{}, {"top_k": 3}, {"top_p": 0.8, "min_p": 0.05}])
def test_output_is_independent_of_draft_and_draft_length(filters):
    rng = np.random.default_rng(0)
    target, good_draft = markov_logits(rng, 8), None
    good_draft = target + rng.normal(size=target.shape).astype(np.float32) * 0.3
    bad_draft = markov_logits(rng, 8)
    for seed in range(5):
        sampling = SamplingParams(temperature=0.9, seed=seed, **filters)
        alone = run(target, target, sampling, 0, 30)
        for draft in (good_draft, bad_draft):
            for k in (1, 3, 6):
                assert run(target, draft, sampling, k, 30) == alone


def test_coupled_sequences_follow_the_oracles_distribution():
    rng = np.random.default_rng(1)
    target = markov_logits(rng, 5)
    draft = markov_logits(rng, 5)
    sampling_for = lambda seed: SamplingParams(temperature=1.0, seed=seed)  # noqa: E731
    pairs = np.zeros((5, 5))
    n = 6000
    for seed in range(n):
        a, b = run(target, draft, sampling_for(seed), 2, 2)
        pairs[a, b] += 1
    p1 = logits_to_probs(target[0], SamplingParams(temperature=1.0))
    joint = p1[:, None] * np.stack([logits_to_probs(target[a], SamplingParams(temperature=1.0)) for a in range(5)])
    assert tv(pairs.ravel(), joint.ravel()) < 0.05


def test_accept_greedy_on_the_oracles_picks_is_what_coupled_uses():
    out, n = accept_greedy(np.array([3, 4]), np.array([3, 1, 2]))
    assert out.tolist() == [3, 1] and n == 1


def test_noise_is_the_documented_draw_whatever_the_cache_holds():
    """The noise is a function of (seed, position, vocab) alone: a row regenerated after it left the
    cache is the same row, so seeded output does not depend on what the cache kept."""
    first = gumbel_noise(-3, 11, 1000).copy()
    for position in range(400):  # more rows than any cache keeps
        gumbel_noise(-3, 1000 + position, 1000)
    again = gumbel_noise(-3, 11, 1000)
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(again, np.random.default_rng((seed_key(-3), 11)).gumbel(size=1000))


def test_noise_cache_is_bounded_by_bytes():
    """A seeded generation at Qwen2.5-7B's vocabulary (152064 tokens, 1.2 MB of float64 noise per
    position) keeps a bounded amount of noise alive (the cache used to hold 256 rows, ~311 MB)."""
    import tracemalloc

    vocab = 152064
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for position in range(80):  # 97 MB of noise rows in all
            gumbel_noise(5, position, vocab)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held <= NOISE_CACHE_BYTES + 2 * vocab * 8
