"""localspec.speculative.sampling: parameter validation, the filters (and their order), sample, log_softmax."""

from __future__ import annotations

import math

import numpy as np
import pytest

from localspec.speculative.proposal import PROPOSAL_TAIL_NATS, SparseRows, proposal_probs
from localspec.speculative.sampling import (SamplingParams, greedy_argmax, log_softmax, logits_to_probs, sample, top_ids,
                                            top_probability, top_probability_at_least)
from scripted import ScriptedRng


def softmax64(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def tv_bound(n_samples: int, n_outcomes: int, delta: float = 1e-6) -> float:
    """TV(empirical, truth) stays below this except with probability delta:
    E[TV] <= 0.5 * sqrt((m - 1) / N), and TV moves by at most 1/N per sample (McDiarmid)."""
    return 0.5 * math.sqrt((n_outcomes - 1) / n_samples) + math.sqrt(math.log(1 / delta) / (2 * n_samples))


def kept(probs: np.ndarray) -> set[int]:
    return set(np.flatnonzero(probs).tolist())


def P(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, **kw})


def log_of(probs) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float64))


# --- SamplingParams ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_params_raise_value_error_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_params_defaults_greedy_and_limits_accepted():
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.7).greedy
    p = SamplingParams(temperature=1.0, top_k=1, top_p=1.0, min_p=1.0, seed=3)
    assert (p.top_k, p.top_p, p.min_p, p.seed) == (1, 1.0, 1.0, 3)
    SamplingParams(temperature=np.float32(0.5), top_k=np.int64(4), top_p=1e-9, min_p=0.0)
    with pytest.raises(AttributeError):
        p.temperature = 2.0  # frozen


# --- shapes, dtype, temperature ----------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.25, 0.5, 1.0, 2.0])
def test_temperature_scales_logits_before_softmax(temperature):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 50)) * 3).astype(np.float32)
    got = logits_to_probs(x, P(temperature=temperature))
    np.testing.assert_allclose(got, softmax64(x.astype(np.float64) / temperature), rtol=2e-6, atol=1e-12)


def test_lower_temperature_is_sharper():
    x = np.array([2.0, 1.0, 0.0, -1.0], dtype=np.float32)
    cold, hot = logits_to_probs(x, P(temperature=0.5)), logits_to_probs(x, P(temperature=2.0))
    assert cold[0] > softmax64(x)[0] > hot[0]
    assert cold[3] < hot[3]


def test_shapes_and_dtype():
    rng = np.random.default_rng(2)
    x2 = rng.standard_normal((4, 30)).astype(np.float32)
    for params in [P(), P(top_k=5), P(top_p=0.8), P(min_p=0.1), SamplingParams()]:
        out2 = logits_to_probs(x2, params)
        out1 = logits_to_probs(x2[2], params)
        assert out2.shape == (4, 30) and out2.dtype == np.float64
        assert out1.shape == (30,) and out1.dtype == np.float64
        np.testing.assert_allclose(out2.sum(axis=1), 1.0, rtol=1e-12)
        np.testing.assert_allclose(out1, out2[2], rtol=1e-12)
    with pytest.raises(ValueError):
        logits_to_probs(np.zeros((2, 3, 4), dtype=np.float32), P())
    with pytest.raises(ValueError):
        logits_to_probs(np.zeros(0, dtype=np.float32), P())


def test_greedy_is_one_hot_at_argmax_first_on_ties_and_ignores_filters():
    x = np.array([[0.0, 3.0, 1.0, 3.0], [5.0, -1.0, 4.0, 2.0]], dtype=np.float32)
    for params in [SamplingParams(), SamplingParams(top_k=3, top_p=0.1, min_p=0.9)]:
        out = logits_to_probs(x, params)
        np.testing.assert_array_equal(out, [[0, 1, 0, 0], [1, 0, 0, 0]])
        assert out.dtype == np.float64


# --- -inf / non-finite -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params", [SamplingParams(), P(), P(temperature=0.3), P(top_k=3), P(top_k=10), P(top_p=0.999), P(min_p=1e-6)]
)
def test_neg_inf_logits_get_probability_zero(params):
    x = np.array([-np.inf, 1.0, -np.inf, 0.5, 2.0, -np.inf], dtype=np.float32)
    out = logits_to_probs(x, params)
    assert np.all(out[[0, 2, 5]] == 0.0)
    assert np.all(np.isfinite(out))
    assert out.sum() == pytest.approx(1.0)


@pytest.mark.parametrize("params", [SamplingParams(), P(), P(top_k=2), P(top_p=0.5), P(min_p=0.5)])
@pytest.mark.parametrize("bad", [[-np.inf, -np.inf, -np.inf], [0.0, np.nan, 1.0], [0.0, np.inf, 1.0]])
def test_rows_without_a_finite_max_raise(params, bad):
    x = np.array([[0.0, 1.0, 2.0], bad], dtype=np.float32)
    with pytest.raises(ValueError, match="finite"):
        logits_to_probs(x, params)


@pytest.mark.parametrize("bad", [[-np.inf, -np.inf, -np.inf], [0.0, np.nan, 1.0], [np.nan, 0.0, 5.0],
                                 [0.0, np.inf, 1.0]])
def test_greedy_argmax_raises_like_the_sampled_paths(bad):
    """numpy's argmax returns a NaN's index: greedy must not emit it (nor +inf's, nor an all -inf row's)."""
    x = np.array([[0.0, 1.0, 2.0], bad], dtype=np.float32)
    with pytest.raises(ValueError, match="finite maximum"):
        greedy_argmax(x)
    with pytest.raises(ValueError, match="finite maximum"):
        greedy_argmax(x[1])
    assert greedy_argmax(np.array([[1.0, 3.0, 3.0], [-np.inf, 0.0, -1.0]])).tolist() == [1, 1]
    assert int(greedy_argmax(np.array([0.0, 2.0, 1.0]))) == 1


# --- top-k -------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 5, 100, 999])
def test_top_k_keeps_exactly_the_k_largest(k):
    rng = np.random.default_rng(k)
    x = rng.standard_normal(1000).astype(np.float32)
    out = logits_to_probs(x, P(top_k=k, temperature=0.7))
    expected = set(np.argsort(-x)[:k].tolist())  # random floats: no ties
    assert kept(out) == expected
    idx = sorted(expected)
    np.testing.assert_allclose(out[idx], softmax64(x[idx].astype(np.float64) / 0.7), rtol=1e-12)


def test_top_k_ties_keep_lowest_ids():
    x = np.array([1, 3, 2, 3, 2, 2, 0], dtype=np.float32)
    assert kept(logits_to_probs(x, P(top_k=3))) == {1, 3, 2}
    assert kept(logits_to_probs(x, P(top_k=4))) == {1, 3, 2, 4}
    assert kept(logits_to_probs(x, P(top_k=1))) == {1}


def test_top_k_at_least_vocab_is_disabled():
    x = np.array([0.5, -1.0, 2.0], dtype=np.float32)
    for k in (3, 50):
        np.testing.assert_array_equal(logits_to_probs(x, P(top_k=k)), logits_to_probs(x, P()))


def test_top_k_beyond_finite_logits_keeps_the_inf_ones_at_zero():
    x = np.array([-np.inf, 1.0, -np.inf, 0.0], dtype=np.float32)
    out = logits_to_probs(x, P(top_k=3))
    np.testing.assert_allclose(out, softmax64(np.array([-np.inf, 1.0, -np.inf, 0.0])), rtol=1e-12)


# --- top-p -------------------------------------------------------------------------------------

# probabilities 0.1 0.4 0.2 0.2 0.1: the order (p descending, id ascending) is 1, 2, 3, 0, 4
HAND = log_of([0.1, 0.4, 0.2, 0.2, 0.1])


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.3, {1}),
        (0.4, {1}),  # exactly reaches 0.4 with one token
        (0.45, {1, 2}),  # the tie between 2 and 3 goes to the lower id
        (0.6, {1, 2}),  # exactly 0.6: smallest prefix reaching it
        (0.7, {1, 2, 3}),
        (0.85, {1, 2, 3, 0}),  # the tie between 0 and 4 goes to the lower id
        (0.95, {0, 1, 2, 3, 4}),
    ],
)
def test_top_p_smallest_prefix_hand_made(top_p, expected):
    out = logits_to_probs(HAND, P(top_p=top_p))
    assert kept(out) == expected
    base = np.array([0.1, 0.4, 0.2, 0.2, 0.1])
    idx = sorted(expected)
    np.testing.assert_allclose(out[idx], base[idx] / base[idx].sum(), rtol=1e-6)


def reference_top_p(p: np.ndarray, top_p: float) -> np.ndarray:
    """Full stable sort, p descending then id ascending: the definition."""
    order = np.lexsort((np.arange(p.size), -p))
    cum = np.cumsum(p[order])
    n = min(int(np.searchsorted(cum, top_p - 1e-9, side="left")) + 1, p.size)
    mask = np.zeros(p.size, dtype=bool)
    mask[order[:n]] = True
    return mask


@pytest.mark.parametrize(
    "vocab, scale, quantise, top_p",
    [
        (5000, 1.0, False, 0.9),
        (5000, 4.0, False, 0.5),
        (70000, 0.5, False, 0.99),  # flat: falls back to the whole row
        (70000, 3.0, False, 0.9),
        (70000, 6.0, False, 0.95),  # peaked: found among p >= 2**-10
        (70000, 3.0, True, 0.8),  # many ties, across candidate thresholds
        (70000, 1.0, True, 0.9),
        (3000, 1.0, True, 0.33),
        (500, 2.0, True, 0.6),
    ],
)
def test_top_p_matches_full_sort_reference(vocab, scale, quantise, top_p):
    rng = np.random.default_rng(vocab + int(10 * scale) + int(quantise))
    x = rng.standard_normal((3, vocab)) * scale
    if quantise:
        x = np.round(x)  # few distinct values: ties everywhere
    x = x.astype(np.float32)
    full = logits_to_probs(x, P())  # the same probabilities the filter sees
    out = logits_to_probs(x, P(top_p=top_p))
    for r in range(3):
        mask = reference_top_p(full[r], top_p)
        np.testing.assert_array_equal(out[r] > 0, mask)
        np.testing.assert_allclose(out[r][mask], full[r][mask] / full[r][mask].sum(), rtol=1e-12)


# --- min-p -------------------------------------------------------------------------------------


def test_min_p_is_relative_to_the_max():
    x = log_of([0.5, 0.3, 0.15, 0.05])
    np.testing.assert_allclose(logits_to_probs(x, P(min_p=0.35)), [0.625, 0.375, 0, 0], rtol=1e-6)
    assert kept(logits_to_probs(x, P(min_p=0.2))) == {0, 1, 2}
    assert kept(logits_to_probs(x, P(min_p=0.09))) == {0, 1, 2, 3}
    assert kept(logits_to_probs(x, P(min_p=1.0))) == {0}
    # ties at the threshold side are all kept
    y = log_of([0.4, 0.2, 0.2, 0.2])
    assert kept(logits_to_probs(y, P(min_p=0.45))) == {0, 1, 2, 3}
    assert kept(logits_to_probs(y, P(min_p=0.55))) == {0}
    # relative, not absolute: a flat distribution keeps everything at min_p = 0.9
    assert kept(logits_to_probs(np.zeros(10, dtype=np.float32), P(min_p=0.9))) == set(range(10))


# --- the order: temperature -> top-k -> top-p -> min-p -------------------------------------------


def test_top_k_runs_before_top_p():
    x = log_of([0.4, 0.3, 0.2, 0.1])
    assert kept(logits_to_probs(x, P(top_p=0.5))) == {0, 1}
    # top-k=2 renormalises to 4/7, 3/7 and 4/7 alone reaches 0.5
    assert kept(logits_to_probs(x, P(top_k=2, top_p=0.5))) == {0}


def test_temperature_runs_before_top_p_and_min_p():
    x = log_of([0.6, 0.3, 0.1])
    assert kept(logits_to_probs(x, P(top_p=0.65))) == {0, 1}
    assert kept(logits_to_probs(x, P(top_p=0.65, temperature=0.5))) == {0}  # [.78, .20, .02]
    assert kept(logits_to_probs(x, P(min_p=0.3))) == {0, 1}
    assert kept(logits_to_probs(x, P(min_p=0.3, temperature=0.5))) == {0}  # .25 < .3


def test_min_p_after_top_p_is_the_intersection():
    x = log_of([0.1, 0.4, 0.2, 0.2, 0.1])
    assert kept(logits_to_probs(x, P(top_p=0.85, min_p=0.4))) == {1, 2, 3}  # min-p binds
    assert kept(logits_to_probs(x, P(top_p=0.45, min_p=0.1))) == {1, 2}  # top-p binds
    assert kept(logits_to_probs(x, P(top_k=3, top_p=0.99, min_p=0.3))) == {1, 2, 3}


@pytest.mark.parametrize("top_p, min_p", [(0.9, 0.01), (0.5, 0.2), (0.99, 0.3), (0.3, 0.001), (0.95, 0.5)])
def test_combined_filters_match_reference(top_p, min_p):
    rng = np.random.default_rng(int(top_p * 100 + min_p * 1000))
    x = (rng.standard_normal((2, 20000)) * 3).astype(np.float32)
    x[1] = np.round(x[1])  # ties
    full = logits_to_probs(x, P(temperature=0.8))
    out = logits_to_probs(x, P(temperature=0.8, top_p=top_p, min_p=min_p))
    for r in range(2):
        mask = reference_top_p(full[r], top_p) & (full[r] >= min_p * full[r].max())
        np.testing.assert_array_equal(out[r] > 0, mask)
        np.testing.assert_allclose(out[r][mask], full[r][mask] / full[r][mask].sum(), rtol=1e-12)


# --- inputs are never written -------------------------------------------------------------------


def test_read_only_and_strided_views_are_not_modified():
    rng = np.random.default_rng(5)
    base = (rng.standard_normal((6, 3000)) * 2).astype(np.float32)
    base[0, :10] = -np.inf
    snapshot = base.copy()
    base.setflags(write=False)  # any write would raise
    views = [base, base[1:4], base[2], base[::2], base[:, ::3]]
    params = [SamplingParams(), P(), P(temperature=0.6), P(top_k=7), P(top_p=0.7), P(min_p=0.2),
              P(top_k=50, top_p=0.9, min_p=0.05)]
    for v in views:
        for prm in params:
            out = logits_to_probs(v, prm)
            assert out.shape == v.shape
            assert not np.shares_memory(out, base)
        log_softmax(v)
    np.testing.assert_array_equal(base, snapshot)


# --- sample ------------------------------------------------------------------------------------


def test_sample_is_inverse_cdf_with_one_uniform():
    w = np.array([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])
    for u, tok in [(0.0, 1), (0.19, 1), (0.21, 3), (0.69, 3), (0.71, 4), (0.999999, 4)]:
        rng = ScriptedRng(u)
        assert sample(w, rng) == tok
        assert rng.calls == 1


def test_sample_consumes_exactly_one_generator_draw():
    probs = softmax64(np.arange(10.0))
    a, b = np.random.default_rng(11), np.random.default_rng(11)
    sample(probs, a)
    b.random()
    assert a.random() == b.random()


def test_sample_seeded_and_never_zero_weight_tokens():
    probs = np.zeros(40)
    probs[[3, 17, 18, 39]] = [0.1, 0.2, 0.3, 0.4]
    draws = [sample(probs, np.random.default_rng(s)) for s in range(3000)]
    assert set(draws) <= {3, 17, 18, 39}
    assert draws == [sample(probs, np.random.default_rng(s)) for s in range(3000)]
    counts = np.bincount(draws, minlength=40) / len(draws)
    assert 0.5 * np.abs(counts - probs).sum() < tv_bound(len(draws), 4)

    def run(seed):
        g = np.random.default_rng(seed)
        return [sample(probs, g) for _ in range(50)]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_sample_accepts_unnormalised_weights():
    w = np.array([1.0, 3.0, 0.0, 4.0])
    for s in range(200):
        assert sample(w, np.random.default_rng(s)) == sample(w / 8.0, np.random.default_rng(s))
    with pytest.raises(ValueError):
        sample(np.zeros(5), np.random.default_rng(0))


def test_sample_over_a_large_vocab_is_the_same_inverse_cdf():
    # above 1024 tokens sample() locates a block first; it must be the same draw as one flat
    # inverse CDF, skip empty blocks and zero weights at block edges, and handle a ragged tail
    rng = np.random.default_rng(12)
    w = rng.random(5000) * (rng.random(5000) < 0.3)
    w[2048:3072] = 0.0  # an empty block
    w[[1023, 1024, 3072, 4999]] = [0.0, 0.0, 0.7, 0.2]
    cdf = np.cumsum(w)
    for u in rng.random(3000):
        expected = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
        assert sample(w, ScriptedRng(u)) == expected
    first, last = np.flatnonzero(w)[[0, -1]]
    assert sample(w, ScriptedRng(0.0)) == first
    assert sample(w, ScriptedRng(1.0 - 2.0**-53)) == last
    draws = {sample(w, rng) for _ in range(3000)}
    assert all(w[t] > 0 for t in draws)


def test_sample_distribution_converges():
    rng = np.random.default_rng(7)
    probs = rng.dirichlet(np.ones(8))
    draws = np.array([sample(probs, rng) for _ in range(50000)])
    tvs = [0.5 * np.abs(np.bincount(draws[:n], minlength=8) / n - probs).sum() for n in (2000, 50000)]
    assert tvs[0] < tv_bound(2000, 8) and tvs[1] < tv_bound(50000, 8)
    assert tvs[1] < tvs[0]


# --- log_softmax -------------------------------------------------------------------------------


def test_log_softmax_raw_logprobs():
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((3, 400)) * 4).astype(np.float32)
    x[1, 5] = -np.inf
    got = log_softmax(x)
    assert got.dtype == np.float64 and got.shape == x.shape
    z = x.astype(np.float64)
    with np.errstate(divide="ignore"):
        ref = np.log(softmax64(z))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(got[finite], ref[finite], atol=1e-6)
    assert got[1, 5] == -np.inf
    np.testing.assert_allclose(np.exp(got).sum(axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(log_softmax(x[2]), got[2], atol=1e-12)
    with pytest.raises(ValueError):
        log_softmax(np.full(4, -np.inf, dtype=np.float32))


def test_top_ids_are_largest_first_and_ties_in_id_order():
    rng = np.random.default_rng(0)
    for _ in range(20):
        row = np.where(rng.random(60) < 0.3, 0.0, rng.integers(-3, 0, 60)).astype(np.float64)  # many ties
        for n in (1, 5, 17, 60, 80):
            order = sorted(range(row.size), key=lambda t: (-row[t], t))[:n]  # value descending, then id
            assert top_ids(row, n).tolist() == order
    assert top_ids(np.array([0.0, 1.0]), 0).size == 0


@pytest.mark.parametrize("scale", [0.1, 3.0, 40.0])
def test_top_probability_is_the_softmax_at_the_argmax(scale):
    rng = np.random.default_rng(7)
    row = (rng.standard_normal(49152) * scale).astype(np.float32)  # [vocab]
    row[5] = -np.inf  # a masked id adds nothing
    token = int(np.argmax(row))
    x = row.astype(np.float64)
    reference = np.exp(x[token] - x.max()) / np.exp(x - x.max()).sum()
    assert top_probability(row, token) == pytest.approx(reference, rel=1e-6)
    assert row.dtype == np.float32 and row[5] == -np.inf  # not written
    assert top_probability(np.array([0.0, -np.inf], dtype=np.float32), 0) == 1.0


@pytest.mark.parametrize("vocab", [50, 49152, 262144])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_top_probability_floor_decides_as_the_whole_softmax(vocab, dtype):
    """The draft's confidence floor, decided from the logits near the top: the same answer as the
    whole row's softmax on rows from very sure to flat, for several floors, with -inf entries too."""
    rng = np.random.default_rng(vocab)
    for trial in range(60):
        row = (rng.standard_normal(vocab) * rng.uniform(0.5, 4)).astype(dtype)
        row[rng.integers(vocab)] += rng.uniform(0, 25)  # from a flat row to a sure one
        if trial % 5 == 0:
            row[rng.integers(vocab, size=vocab // 10)] = -np.inf
        token = int(row.argmax())
        for p_min in (0.05, 0.3, 0.5, 0.9):
            assert top_probability_at_least(row, token, p_min) == (top_probability(row, token) >= p_min)


def test_top_probability_floor_falls_back_where_the_far_logits_could_tip_it():
    """A row whose near logits leave the answer open (S within the far logits' bound of 1/p_min):
    the whole row is summed, and the far logits do tip it."""
    vocab = 1000
    margin = math.log(vocab) + 2.2
    row = np.full(vocab, -margin - 0.01)  # 999 far logits: together they add ~0.11 to S
    row[0] = 0.0
    s_far = (vocab - 1) * math.exp(-margin - 0.01)
    p_min = 1 / (1 + s_far / 2)  # 1/p_min lies between S's near part (1) and the whole S
    assert top_probability(row, 0) < p_min
    assert not top_probability_at_least(row, 0, p_min)
    assert top_probability_at_least(row, 0, 1 / (1 + 2 * s_far))


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7),
                                    SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.2, top_p=0.8),
                                    SamplingParams(temperature=0.9, min_p=0.1, top_p=0.95)])
def test_probabilities_written_into_kept_memory_are_the_same(params):
    """logits_to_probs(..., out=) writes the very probabilities it would return fresh (into a row
    of kept memory, whatever that held before), and refuses an array of another shape or type."""
    from localspec.speculative.sampling import scratch

    logits = (np.random.default_rng(2).standard_normal((3, 500)) * 2).astype(np.float32)
    fresh = logits_to_probs(logits, params)
    out = np.full((3, 500), 7.0)
    assert logits_to_probs(logits, params, out=out) is out
    np.testing.assert_array_equal(out, fresh)
    with pytest.raises(ValueError):
        logits_to_probs(logits, params, out=np.empty((3, 500), dtype=np.float32))
    with pytest.raises(ValueError):
        logits_to_probs(logits, params, out=np.empty(500))
    a, b = scratch(100, slot="x"), scratch((2, 50), slot="x")
    assert np.shares_memory(a, b) and not np.shares_memory(a, scratch(100, slot="y"))
    from localspec.speculative.sampling import SCRATCH_KEEP_BYTES
    big = SCRATCH_KEEP_BYTES // 8 + 1
    assert not np.shares_memory(scratch(big, slot="x"), scratch(big, slot="x"))  # too big to keep: fresh


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=0.8, top_k=20, min_p=0.01)],
                         ids=["temperature", "filtered"])
def test_a_drafts_proposal_leaves_out_only_the_far_tail(params):
    """`proposal_probs` on a real-sized row: the request's distribution over the tokens within
    (log(vocab) + PROPOSAL_TAIL_NATS) * temperature of the top, renormalised, zero elsewhere; the
    ids and probabilities it returns are that distribution's support; the tail it left out weighs
    under e^-PROPOSAL_TAIL_NATS."""
    rng = np.random.default_rng(9)
    row = (rng.standard_normal(49152) * 2.0).astype(np.float32)
    row[rng.integers(0, 49152, 30)] += 9.0  # a few likely tokens above the bulk
    ids, probs = proposal_probs(row, params)
    near = row >= row.max() - (math.log(row.size) + PROPOSAL_TAIL_NATS) * params.temperature
    assert 0 < near.sum() < row.size // 2 and ids.tolist() == np.flatnonzero(near).tolist()
    reference = logits_to_probs(np.where(near, row, -np.inf), params)
    np.testing.assert_allclose(probs, reference[ids], rtol=1e-5, atol=1e-12)
    assert probs.sum() == pytest.approx(1.0) and not reference[~near].any()
    full = logits_to_probs(row, SamplingParams(temperature=params.temperature))
    assert full[~near].sum() < math.exp(-PROPOSAL_TAIL_NATS)


def test_a_drafts_proposal_keeps_the_whole_row_where_the_tail_is_not_most_of_it():
    row = np.linspace(0.0, 3.0, 1000).astype(np.float32)  # every logit within reach of the top
    ids, probs = proposal_probs(row, SamplingParams(temperature=1.0))
    assert ids.tolist() == list(range(1000))
    np.testing.assert_allclose(probs, logits_to_probs(row, SamplingParams(temperature=1.0)), rtol=1e-12)


def test_sparse_rows_read_as_the_dense_array_would():
    """`SparseRows`: each row's support and weights, read id for id, row for row and whole as the
    dense [n, vocab] array; a snapshot keeps its rows when the rows are cleared and refilled."""
    gen = np.random.default_rng(4)
    rows, dense = SparseRows(50), np.zeros((3, 50))
    for r in range(3):
        ids = np.sort(gen.choice(50, 5 + r, replace=False))
        probs = gen.dirichlet(np.ones(ids.size))
        rows.add(ids, probs)
        dense[r, ids] = probs
    assert rows.shape == (3, 50) and len(rows) == 3
    kept = rows.snapshot()
    rows.clear()
    rows.add(np.array([7]), np.ones(1))
    assert rows.shape == (1, 50) and SparseRows(50).snapshot() is None
    np.testing.assert_array_equal(np.asarray(kept), dense)
    for r in range(3):
        np.testing.assert_array_equal(kept[r], dense[r])
        assert [kept[r, t] for t in range(50)] == dense[r].tolist()
    assert rows[0, 7] == 1.0 and rows[0, 6] == 0.0 and rows[0, 49] == 0.0
