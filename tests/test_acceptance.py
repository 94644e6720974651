"""localspec.speculative.acceptance: exact cases, edge cases, and the statistical guarantee that speculative
sampling emits exactly the oracle's autoregressive distribution."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import pytest

from localspec.speculative.acceptance import accept_draft, accept_greedy
from localspec.speculative.proposal import SparseRows, proposal_probs
from localspec.speculative.sampling import SamplingParams, logits_to_probs, sample
from scripted import ScriptedRng


def tv_bound(n_samples: int, n_outcomes: int, delta: float = 1e-6) -> float:
    """TV(empirical, truth) stays below this except with probability delta:
    E[TV] <= 0.5 * sqrt((m - 1) / N), and TV moves by at most 1/N per sample (McDiarmid)."""
    return 0.5 * math.sqrt((n_outcomes - 1) / n_samples) + math.sqrt(math.log(1 / delta) / (2 * n_samples))


def tv(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(np.asarray(a, dtype=np.float64) - b).sum())


def onehot(i: int, vocab: int) -> np.ndarray:
    v = np.zeros(vocab)
    v[i] = 1.0
    return v


# --- accept_greedy ------------------------------------------------------------------------------


def test_greedy_accepts_two_then_emits_the_oracle_argmax():
    out, n = accept_greedy(np.array([5, 7, 9]), np.array([5, 7, 3, 8]))
    assert n == 2
    assert out.tolist() == [5, 7, 3] and out.dtype == np.int32


def test_greedy_all_accepted_plus_bonus():
    out, n = accept_greedy(np.array([1, 2, 3]), np.array([1, 2, 3, 4]))
    assert (out.tolist(), n) == ([1, 2, 3, 4], 3)


def test_greedy_first_token_rejected_and_empty_draft():
    out, n = accept_greedy(np.array([1]), np.array([0, 1]))
    assert (out.tolist(), n) == ([0], 0)
    out, n = accept_greedy(np.array([], dtype=np.int32), np.array([6]))
    assert (out.tolist(), n) == ([6], 0)
    # a later match does not count once a mismatch happened
    out, n = accept_greedy(np.array([4, 9, 4]), np.array([4, 2, 4, 4]))
    assert (out.tolist(), n) == ([4, 2], 1)
    with pytest.raises(ValueError):
        accept_greedy(np.array([1, 2]), np.array([1, 2]))


def test_accept_draft_with_one_hot_oracle_and_no_draft_probs_equals_accept_greedy():
    rng = np.random.default_rng(0)
    vocab, k = 7, 4
    for _ in range(300):
        logits = rng.standard_normal((k + 1, vocab)).astype(np.float32)
        target = logits_to_probs(logits, SamplingParams())  # greedy: one-hot rows
        argmax = logits.argmax(axis=1)
        draft = np.where(rng.random(k) < 0.7, argmax[:k], rng.integers(0, vocab, k))
        out, n = accept_draft(draft, None, target, rng)
        g_out, g_n = accept_greedy(draft, argmax)
        assert n == g_n
        np.testing.assert_array_equal(out, g_out)


# --- accept_draft: exact cases -------------------------------------------------------------------


def test_certain_acceptance_when_target_at_least_draft_and_bonus():
    vocab = 4
    draft_probs = np.full((3, vocab), 0.25)  # [k, vocab]
    target = np.array([[0.1, 0.5, 0.2, 0.2], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.7, 0.3], onehot(3, vocab)])
    draft = np.array([1, 0, 2])  # target >= draft at each
    for seed in range(300):
        out, n = accept_draft(draft, draft_probs, target, np.random.default_rng(seed))
        assert n == 3
        assert out.tolist() == [1, 0, 2, 3] and out.dtype == np.int32


def test_k_zero_samples_from_target_row_0():
    for draft_probs in (None, np.empty((0, 3))):
        out, n = accept_draft(np.array([], dtype=np.int64), draft_probs, onehot(2, 3)[None], np.random.default_rng(0))
        assert (out.tolist(), n) == ([2], 0)
    rng = np.random.default_rng(1)
    target = np.array([[0.2, 0.5, 0.3]])
    draws = [accept_draft(np.array([], dtype=np.int64), None, target, rng)[0][0] for _ in range(20000)]
    assert tv(np.bincount(draws, minlength=3) / len(draws), target[0]) < tv_bound(len(draws), 3)


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_a_draft_token_the_oracle_forbids_is_never_accepted_nor_emitted(with_draft_probs):
    target = np.array([[0.3, 0.0, 0.3, 0.2, 0.2], [0.2] * 5])
    draft_probs = np.array([[0.05, 0.9, 0.05, 0.0, 0.0]]) if with_draft_probs else None
    emitted = set()
    for seed in range(2000):
        out, n = accept_draft(np.array([1]), draft_probs, target, np.random.default_rng(seed))
        assert n == 0 and len(out) == 1
        emitted.add(int(out[0]))
    assert 1 not in emitted
    # the recovered token covers the rest of the oracle's support
    assert emitted == {0, 2, 3, 4}


def test_rejection_recovers_from_the_residual():
    # target one-hot at 2, draft proposes 1: always rejected, and the residual is exactly token 2
    vocab = 4
    q = np.array([[0.1, 0.6, 0.2, 0.1]])
    p = np.stack([onehot(2, vocab), np.full(vocab, 0.25)])
    for seed in range(200):
        out, n = accept_draft(np.array([1]), q, p, np.random.default_rng(seed))
        assert (out.tolist(), n) == ([2], 0)


def test_scripted_acceptance_threshold_and_residual_sampling():
    q = np.array([[0.1, 0.6, 0.2, 0.1]])  # q(d=1) = 0.6
    p = np.array([[0.4, 0.3, 0.1, 0.2], [0.0, 0.0, 0.0, 1.0]])  # p(d=1) = 0.3: accept w.p. 0.5
    d = np.array([1])
    rng = ScriptedRng(0.49, 0.0)
    out, n = accept_draft(d, q, p, rng)
    assert (out.tolist(), n) == ([1, 3], 1)
    assert rng.calls == 2  # one test, one bonus draw
    # rejected: residual max(0, p - q) = [0.3, 0, 0, 0.1] -> token 0 for u < 0.75, else 3
    for u2, tok in [(0.0, 0), (0.7, 0), (0.76, 3), (0.999, 3)]:
        rng = ScriptedRng(0.51, u2)
        out, n = accept_draft(d, q, p, rng)
        assert (out.tolist(), n) == ([tok], 0)
        assert rng.calls == 2  # one test, one recovered draw


def test_scripted_point_mass_rule():
    # draft_probs None: accept with probability p(d); on rejection p with d zeroed
    p = np.array([[0.2, 0.4, 0.3, 0.1], [0.25] * 4])
    d = np.array([1])
    out, n = accept_draft(d, None, p, ScriptedRng(0.39, 0.999))
    assert (out.tolist(), n) == ([1, 3], 1)
    for u2, tok in [(0.0, 0), (0.3, 0), (0.5, 2), (0.95, 3)]:  # residual [.2, 0, .3, .1]
        out, n = accept_draft(d, None, p, ScriptedRng(0.41, u2))
        assert (out.tolist(), n) == ([tok], 0)


def test_scripted_draft_prob_zero_is_treated_as_a_point_mass():
    # the draft gave d probability 0 yet proposed it: accept w.p. p(d), not min(1, p/0) = 1
    q = np.array([[0.5, 0.0, 0.5, 0.0]])
    p = np.array([[0.2, 0.4, 0.3, 0.1], [0.25] * 4])
    d = np.array([1])
    out, n = accept_draft(d, q, p, ScriptedRng(0.39, 0.0))
    assert (out.tolist(), n) == ([1, 0], 1)
    out, n = accept_draft(d, q, p, ScriptedRng(0.41, 0.95))
    # not the residual max(0, p - q) = [0, .4, 0, .1] (which would emit d itself), but p without d
    assert (out.tolist(), n) == ([3], 0)
    out, n = accept_draft(d, q, p, ScriptedRng(0.41, 0.5))
    assert (out.tolist(), n) == ([2], 0)


def test_zero_residual_falls_back_to_the_target():
    # p <= q everywhere (p == q up to rounding): the residual is all zero
    q = np.array([[0.5, 0.5]])
    p = np.array([[0.5 * (1 - 1e-12), 0.5], [1.0, 0.0]])
    out, n = accept_draft(np.array([0]), q, p, ScriptedRng(1 - 1e-15, 0.75))
    assert (out.tolist(), n) == ([1], 0)


def test_rejection_at_a_later_position_keeps_the_accepted_prefix():
    q = np.array([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0]])
    p = np.array([[1.0, 0, 0], [0, 1.0, 0], [0.5, 0, 0.5], [0, 0, 1.0]])
    out, n = accept_draft(np.array([0, 1, 2]), q, p, ScriptedRng(0.3, 0.3, 0.6, 0.1))
    assert (out.tolist(), n) == ([0, 1, 0], 2)


def test_shape_validation():
    rng = np.random.default_rng(0)
    p = np.full((3, 4), 0.25)
    with pytest.raises(ValueError):
        accept_draft(np.array([1, 2, 3]), None, p, rng)  # needs k+1 rows
    with pytest.raises(ValueError):
        accept_draft(np.array([1, 2]), np.full((2, 5), 0.2), p, rng)
    with pytest.raises(ValueError):
        accept_draft(np.array([1, 4]), None, p, rng)  # id out of range


def test_seeded_determinism():
    rng = np.random.default_rng(3)
    vocab, k = 50, 5
    q = rng.dirichlet(np.full(vocab, 0.3), size=k)
    p = rng.dirichlet(np.full(vocab, 0.3), size=k + 1)
    d = np.array([sample(q[i], rng) for i in range(k)])

    def run(seed, draft_probs):
        g = np.random.default_rng(seed)
        return [accept_draft(d, draft_probs, p, g)[0].tolist() for _ in range(100)]

    for draft_probs in (q, None):
        assert run(7, draft_probs) == run(7, draft_probs)
        assert run(7, draft_probs) != run(8, draft_probs)


# --- the statistical guarantee -------------------------------------------------------------------
#
# A toy Markov "language": the oracle's next-token distribution depends on the previous token
# (target[prev] is a row of a [vocab, vocab] table), and so does the draft's. One speculative
# step from `prev` drafts d_1..d_k, scores target rows [prev, d_1, .., d_k], and accepts. We
# collect the first two emitted tokens (running a second step when the first step emitted only
# one) and compare with the oracle's autoregressive joint target[prev, a] * target[a, b].

# A drafter maps the previous tokens of n generations [n] to their drafts: tokens [n, k] and
# draft_probs [n, k, vocab] or None.
Drafter = Callable[[np.ndarray, np.random.Generator], "tuple[np.ndarray, np.ndarray | None]"]
K = 3


def draw(table: np.ndarray, last: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One inverse-CDF draw from table[last[j]] for each j (vectorised): [n] -> [n]."""
    cdf = np.cumsum(table[last], axis=1)  # [n, vocab]
    u = rng.random(len(last)) * cdf[:, -1]
    return np.minimum((cdf <= u[:, None]).sum(axis=1), table.shape[1] - 1)


def contexts(prev: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The token before each verified position: [n], [n, k] -> [n, k+1]."""
    return np.concatenate((prev[:, None], tokens), axis=1)


def sampling_drafter(q_table: np.ndarray, k: int = K) -> Drafter:
    """A draft model: each d_i drawn from its own distribution q_table[previous token]."""

    def drafter(prev, rng):
        tokens = np.empty((len(prev), k), dtype=np.int64)
        last = prev
        for i in range(k):
            last = tokens[:, i] = draw(q_table, last, rng)
        return tokens, q_table[contexts(prev, tokens)[:, :-1]]  # [n, k], [n, k, vocab]

    return drafter


def point_drafter(next_token: np.ndarray, k: int = K) -> Drafter:
    """A greedy or model-free draft (e.g. prompt lookup): next_token[last], no probabilities."""

    def drafter(prev, rng):
        tokens = np.empty((len(prev), k), dtype=np.int64)
        last = prev
        for i in range(k):
            last = tokens[:, i] = next_token[last]
        return tokens, None

    return drafter


def argmax_drafter_with_softmax(q_table: np.ndarray, k: int = K) -> Drafter:
    """The biased scheme: draft the argmax but verify against the draft's softmax."""
    inner = point_drafter(q_table.argmax(axis=1), k)

    def drafter(prev, rng):
        tokens, _ = inner(prev, rng)
        return tokens, q_table[contexts(prev, tokens)[:, :-1]]

    return drafter


def first_two_emitted(prev: int, target: np.ndarray, drafter: Drafter, n: int, seed: int):
    """Run n independent generations from `prev`; return their first two emitted tokens [n, 2]
    and the n_accepted of each first step [n]."""
    rng = np.random.default_rng(seed)

    def steps(last: np.ndarray) -> list[tuple[np.ndarray, int]]:
        tokens, draft_probs = drafter(last, rng)  # [m, k], [m, k, vocab] or None
        rows = target[contexts(last, tokens)]  # [m, k+1, vocab]
        return [
            accept_draft(tokens[j], None if draft_probs is None else draft_probs[j], rows[j], rng)
            for j in range(len(last))
        ]

    first = steps(np.full(n, prev, dtype=np.int64))
    n_acc = np.array([a for _, a in first])
    assert all(out.size == a + 1 for out, a in first)
    pairs = np.array([out[:2] if out.size >= 2 else (out[0], -1) for out, _ in first], dtype=np.int64)
    again = np.flatnonzero(pairs[:, 1] < 0)  # one token emitted: the second comes from the next step
    pairs[again, 1] = [out[0] for out, _ in steps(pairs[again, 0])]
    return pairs, n_acc


def tv_first_and_joint(pairs: np.ndarray, prev: int, target: np.ndarray, n: int) -> tuple[float, float]:
    vocab = target.shape[0]
    first = np.bincount(pairs[:n, 0], minlength=vocab) / n
    joint = np.bincount(pairs[:n, 0] * vocab + pairs[:n, 1], minlength=vocab * vocab) / n
    true_joint = target[prev][:, None] * target  # [vocab, vocab]: P(a) * P(b | a)
    return tv(first, target[prev]), tv(joint, true_joint.ravel())


def assert_emits_the_oracle_distribution(pairs: np.ndarray, prev: int, target: np.ndarray) -> None:
    """The first token ~ target[prev] and the first two ~ the oracle's joint: TV below the
    sample-size bound on the first 2000 samples and on all of them, and shrinking between."""
    m_first = int(np.count_nonzero(target[prev]))
    m_joint = int(np.count_nonzero(target[prev][:, None] * target))
    small, large = 2000, len(pairs)
    tvs = {}
    for n in (small, large):
        tv1, tv2 = tvs[n] = tv_first_and_joint(pairs, prev, target, n)
        assert tv1 < tv_bound(n, m_first), f"first token, {n} samples: TV {tv1:.4f}"
        assert tv2 < tv_bound(n, m_joint), f"first two tokens, {n} samples: TV {tv2:.4f}"
    assert tvs[large][0] < tvs[small][0] and tvs[large][1] < tvs[small][1], tvs


def markov_tables(vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """target [vocab, vocab] and draft [vocab, vocab] next-token tables that partly agree; the
    target forbids a few tokens outright."""
    rng = np.random.default_rng(seed)
    target = rng.dirichlet(np.full(vocab, 0.8), size=vocab)
    target[rng.random((vocab, vocab)) < 0.15] = 0.0
    target[np.arange(vocab), rng.integers(0, vocab, vocab)] += 0.05  # no all-zero row
    target /= target.sum(axis=1, keepdims=True)
    draft = 0.5 * target + 0.5 * rng.dirichlet(np.full(vocab, 0.8), size=vocab)
    return target, draft


def test_speculative_sampling_emits_the_oracle_distribution():
    target, draft = markov_tables(6, seed=10)
    pairs, n_acc = first_two_emitted(0, target, sampling_drafter(draft), 50000, seed=11)
    # every branch was exercised: first-token rejections, partial and full acceptance
    counts = np.bincount(n_acc, minlength=K + 1) / n_acc.size
    assert np.all(counts > 0.02), counts
    assert_emits_the_oracle_distribution(pairs, 0, target)


def test_speculative_sampling_with_filters_applied_to_both_models():
    rng = np.random.default_rng(20)
    vocab = 8
    target_logits = rng.standard_normal((vocab, vocab)).astype(np.float32) * 2  # [prev, vocab]
    draft_logits = (0.6 * target_logits + rng.standard_normal((vocab, vocab)) * 1.5).astype(np.float32)
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05)
    target = logits_to_probs(target_logits, params)
    draft = logits_to_probs(draft_logits, params)
    assert np.all((target > 0).sum(axis=1) < vocab)  # the filters did remove tokens
    assert np.any((draft > 0) & (target == 0))  # the draft can propose tokens the oracle forbids
    pairs, n_acc = first_two_emitted(1, target, sampling_drafter(draft), 20000, seed=21)
    assert np.all(np.bincount(n_acc, minlength=K + 1) > 0)
    assert_emits_the_oracle_distribution(pairs, 1, target)


def test_a_draft_without_its_far_tail_still_emits_the_oracle_distribution():
    """A sampled draft model drafts from its distribution less the far tail (`proposal_probs`):
    tokens the oracle gives real weight get none from the draft; what is emitted is the oracle's."""
    rng = np.random.default_rng(50)
    vocab = 8
    target_logits = rng.standard_normal((vocab, vocab)).astype(np.float32) * 1.5  # [prev, vocab]
    draft_logits = (target_logits + rng.standard_normal((vocab, vocab)) * 4).astype(np.float32)  # far spread
    params = SamplingParams(temperature=0.8)
    target = logits_to_probs(target_logits, params)
    draft = np.zeros((vocab, vocab))
    for prev in range(vocab):
        ids, probs = proposal_probs(draft_logits[prev], params)
        draft[prev, ids] = probs
    cut = (draft == 0) & (logits_to_probs(draft_logits, params) > 0)
    assert cut.sum() >= vocab and target[cut].max() > 0.05  # the tail left out, weighty for the oracle
    pairs, n_acc = first_two_emitted(4, target, sampling_drafter(draft), 20000, seed=51)
    assert np.all(np.bincount(n_acc, minlength=K + 1) > 0)
    assert_emits_the_oracle_distribution(pairs, 4, target)


@pytest.mark.parametrize("kind", ["greedy draft model", "prompt lookup", "adversarial"])
def test_point_mass_drafts_emit_the_oracle_distribution(kind):
    target, draft = markov_tables(6, seed=30)
    next_token = {
        "greedy draft model": draft.argmax(axis=1),
        "prompt lookup": (np.arange(6) + 1) % 6,
        "adversarial": target.argmin(axis=1),  # the oracle's least likely (often forbidden) token
    }[kind]
    pairs, n_acc = first_two_emitted(2, target, point_drafter(next_token), 20000, seed=31)
    assert_emits_the_oracle_distribution(pairs, 2, target)
    if kind == "greedy draft model":
        assert np.mean(n_acc > 0) > 0.1


def test_draft_token_with_draft_probability_zero_still_emits_the_oracle_distribution():
    # the draft proposes d_1 = 4 where its own q gives 4 probability 0; the rest of the draft
    # is drawn properly. Conditionally on that, the output must still be exact.
    target, draft = markov_tables(6, seed=40)
    prev, forced = 3, 4
    draft[prev, forced] = 0.0
    draft[prev] /= draft[prev].sum()
    assert target[prev, forced] > 0.1
    proper, rest = sampling_drafter(draft), sampling_drafter(draft, K - 1)

    def drafter(last, rng):
        tokens, probs = proper(last, rng)
        at_prev = np.flatnonzero(last == prev)
        tail, tail_probs = rest(np.full(at_prev.size, forced), rng)
        tokens[at_prev, 0], tokens[at_prev, 1:] = forced, tail
        probs[at_prev, 0], probs[at_prev, 1:] = draft[prev], tail_probs
        return tokens, probs

    pairs, n_acc = first_two_emitted(prev, target, drafter, 20000, seed=41)
    # accepted with probability target[prev, forced] (point mass), not always (min(1, p/0))
    assert abs(np.mean(n_acc > 0) - target[prev, forced]) < 0.02
    assert_emits_the_oracle_distribution(pairs, prev, target)


def test_the_statistical_check_catches_a_biased_scheme():
    # negative control: drafting the argmax while verifying against the draft's softmax (the
    # bias DESIGN.md warns about) must fail the same bound.
    target, draft = markov_tables(6, seed=10)
    pairs, _ = first_two_emitted(0, target, argmax_drafter_with_softmax(draft), 20000, seed=51)
    tv1, tv2 = tv_first_and_joint(pairs, 0, target, len(pairs))
    m_joint = int(np.count_nonzero(target[0][:, None] * target))
    assert tv2 > 2 * tv_bound(len(pairs), m_joint), (tv1, tv2)


def test_accept_takes_the_target_as_the_request_asked_for_it_and_its_regimes_rule():
    """acceptance.accept is handed every input: the raw logits, the request's bias and the grammar's
    masks make the target; greedy takes its argmax (or llama.cpp's picks, logits unread), sampled
    requests get speculative sampling, seeded ones the oracle alone's seeded picks."""
    from localspec.speculative.acceptance import accept
    from localspec.speculative.sampling import SamplingParams

    logits = np.array([[3.0, 2.0, 0.0, 0.0], [0.0, 3.0, 2.0, 0.0], [0.0, 0.0, 3.0, 2.0]])  # [k+1 = 3, vocab 4]
    draft = np.array([0, 1])
    rng = np.random.default_rng(0)
    out, n = accept(draft, None, logits, SamplingParams(), rng, position=5)
    assert (out.tolist(), n) == ([0, 1, 2], 2)  # the argmax everywhere: both accepted, the bonus
    biased = SamplingParams(logit_bias=((1, 5.0),))
    out, n = accept(draft, None, logits, biased, rng, position=5)
    assert (out.tolist(), n) == ([1], 0)  # the biased oracle's argmax at the first row is 1
    masks = np.array([[True, True, True, True], [True, False, True, True], [True, True, True, True]])
    out, n = accept(draft, None, logits, SamplingParams(), rng, position=5, masks=masks)
    assert (out.tolist(), n) == ([0, 2], 1)  # the grammar forbids 1 at the second row
    out, n = accept(draft, None, np.zeros((3, 0)), SamplingParams(), rng, position=5, picked=np.array([0, 3, 1]))
    assert (out.tolist(), n) == ([0, 3], 1)  # llama.cpp's picks: the logits are not read
    seeded = SamplingParams(temperature=0.8, seed=7)
    a = accept(draft, None, logits, seeded, np.random.default_rng(1), position=5)
    b = accept(draft, None, logits, seeded, np.random.default_rng(2), position=5)
    assert a[0].tolist() == b[0].tolist()  # the seed and the position decide, not the generator
    sampled = SamplingParams(temperature=1.0)
    out, n = accept(draft, None, logits, sampled, np.random.default_rng(3), position=5)
    assert len(out) == n + 1 and 0 <= n <= 2


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_p=0.9),
                                    SamplingParams(temperature=0.9, top_k=20, min_p=0.02)])
@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_accept_reads_the_targets_rows_lazily_and_decides_as_the_whole_array(params, with_draft_probs):
    """`accept` computes the oracle's rows only up to the first rejection (`LazyProbs`), in memory
    kept from step to step, and under the temperature alone only the row a token is drawn from
    (an accepted token's test reads its one probability): each outcome, generator draw for draw,
    is the one the whole [k+1, vocab] array of probabilities gives, and no row past the rejection
    is computed."""
    from localspec.speculative.acceptance import accept
    from localspec.speculative.sampling import LazyProbs

    gen = np.random.default_rng(11)
    vocab, k = 300, 6
    for trial in range(60):
        target_logits = (gen.standard_normal((k + 1, vocab)) * 2.0).astype(np.float32)  # [k+1, vocab]
        draft_logits = target_logits[:k] + gen.standard_normal((k, vocab)).astype(np.float32) * (trial % 3)
        draft_probs = logits_to_probs(draft_logits, params)  # [k, vocab]
        draft = np.array([sample(row, gen) for row in draft_probs])
        whole = accept_draft(draft, draft_probs if with_draft_probs else None, logits_to_probs(target_logits, params),
                             np.random.default_rng(trial))
        lazy = accept(draft, draft_probs if with_draft_probs else None, target_logits, params,
                      np.random.default_rng(trial), position=0)
        assert lazy[0].tolist() == whole[0].tolist() and lazy[1] == whole[1]
        rows = LazyProbs(target_logits, params)
        accept_draft(draft, draft_probs if with_draft_probs else None, rows, np.random.default_rng(trial))
        whole_rows = [i for i, done in enumerate(rows._done) if done]
        if params.top_k or params.top_p < 1.0 or params.min_p:  # filtered: the rows up to the rejection (or the bonus)
            assert whole_rows == list(range(whole[1] + 1))
        else:  # the temperature alone: an accepted token's test reads one probability, no row
            assert whole_rows == [whole[1]]


def test_the_seeded_check_stops_at_the_first_disagreement_and_matches_the_picks():
    """Seeded sampling's check (`accept_coupled`) emits what accept_greedy makes of the oracle's
    seeded pick at every row, computing the rows only while the draft agrees."""
    from localspec.speculative.acceptance import accept_coupled
    from localspec.speculative.sampling import LazyProbs, coupled_choice

    gen = np.random.default_rng(5)
    params = SamplingParams(temperature=0.8, seed=3)
    vocab, k = 200, 5
    for trial in range(40):
        logits = (gen.standard_normal((k + 1, vocab)) * 3.0).astype(np.float32)  # [k+1, vocab]
        probs = logits_to_probs(logits, params)
        picks = np.array([coupled_choice(row, 3, 10 + i) for i, row in enumerate(probs)])
        draft = picks[:k].copy()
        if trial % 2:
            draft[trial % k] = (draft[trial % k] + 1) % vocab  # a disagreement there
        expected = accept_greedy(draft, picks)
        rows = LazyProbs(logits, params)
        out, n = accept_coupled(draft, rows, 3, 10)
        assert (out.tolist(), n) == (expected[0].tolist(), expected[1])
        assert rows._done == [True] * (n + 1) + [False] * (k - n)  # computed while the draft agreed, none after
    with pytest.raises(ValueError):
        accept_coupled(np.array([1, 2]), LazyProbs(np.zeros((2, 4), np.float32), params), 3, 0)


def test_sparse_draft_rows_decide_as_the_dense_array():
    """A sampled draft's distributions held as their supports (`SparseRows`, as the draft model
    hands them on) give every outcome, generator draw for draw, that the dense array gives."""
    gen = np.random.default_rng(12)
    vocab, k = 300, 5
    for trial in range(60):
        target_probs = logits_to_probs((gen.standard_normal((k + 1, vocab)) * 2.0).astype(np.float32),
                                       SamplingParams(temperature=0.8))
        rows = SparseRows(vocab)
        for _ in range(k):
            ids = np.sort(gen.choice(vocab, 40, replace=False))
            rows.add(ids, gen.dirichlet(np.ones(40)))
        dense = np.asarray(rows)  # [k, vocab]
        draft = np.array([sample(row, gen) if trial % 3 else int(gen.integers(vocab)) for row in dense])  # some off the support
        sparse = accept_draft(draft, rows, target_probs, np.random.default_rng(trial))
        whole = accept_draft(draft, dense, target_probs, np.random.default_rng(trial))
        assert sparse[0].tolist() == whole[0].tolist() and sparse[1] == whole[1]
