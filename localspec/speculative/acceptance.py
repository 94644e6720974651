"""Pure-numpy acceptance of a draft against the oracle (target) model, for one sequence.

The oracle scores the verify batch ``[last, d_0 .. d_{k-1}]`` and yields ``target_probs``
[k+1, vocab]: row i is its distribution at the position of d_i; row k is the position after the
whole draft. Both functions return ``(output_tokens, n_accepted)`` with
``output_tokens == accepted draft tokens + [recovered or bonus token]``, so
``len(output_tokens) == n_accepted + 1``:

* the *recovered* token is emitted at the first rejected position, in place of the draft token;
* the *bonus* token is sampled from ``target_probs[k]`` when all k draft tokens were accepted.

``accept_draft`` is speculative sampling (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling"): every emitted token is distributed exactly as the oracle's
autoregressive distribution, whatever the draft, provided each draft token d_i really was
drawn from ``draft_probs[i]`` (or, for point-mass drafts, whatever way it was chosen).

Point-mass positions. When ``draft_probs`` is None (greedy or model-free drafts), the draft is a
point mass on d_i: q = onehot(d_i). The general rule then reads: accept with probability
min(1, p(d_i) / 1) = p(d_i); on rejection sample from max(0, p - onehot(d_i)), i.e. p with d_i
zeroed and renormalised. Conditional on d_i the emitted token is then distributed exactly as p:
P(d_i) = p(d_i), and P(x) = (1 - p(d_i)) * p(x) / (1 - p(d_i)) = p(x) for x != d_i.

``draft_probs[i, d_i] == 0``: a token the draft could not have proposed. Had d_i been drawn
from q this has probability 0, so any rule is exact on paper; in practice it means the caller
drafted d_i some other way (e.g. the argmax of unfiltered logits against a filtered q), and the
rule must not add bias of its own. min(1, p/0) = 1 would always accept it: d_i would be emitted
with probability 1 instead of p(d_i). We treat such a position as a point mass on d_i, which is
exact *conditionally on d_i*, however d_i was chosen: the emitted token is distributed as p
(as with rejecting outright and sampling from p, but an accepted d_i keeps the rest of the
draft alive).

Other edge cases: k == 0 samples the bonus token from ``target_probs[0]``; a draft token the
oracle forbids (p(d_i) == 0) is always rejected (``u * q < 0`` is never true) and, having
residual weight 0, never emitted; a residual of total mass 0 (only possible when p == q up to
rounding, where rejection has probability ~0) falls back to sampling from p.

All probability rows are expected normalised (as ``sampling.logits_to_probs`` returns them).
Randomness: one ``rng.random()`` per acceptance test, one for the recovered or bonus token.
"""

from __future__ import annotations

import numpy as np

from localspec.speculative.proposal import SparseRows
from localspec.speculative.sampling import (LazyProbs, SamplingParams, bias_logits, coupled_choice, draw_or_none,
                                            greedy_argmax, mask_logits, sample, scratch)


def accept_greedy(draft_tokens: np.ndarray, target_argmax: np.ndarray) -> tuple[np.ndarray, int]:
    """draft_tokens [k] int; target_argmax [k+1] int, the oracle's argmax at each verified position.

    Accept while draft_tokens[i] == target_argmax[i]; then emit target_argmax at the first
    mismatch (recovered) or target_argmax[k] (bonus). Returns (output_tokens [n_accepted+1] int32,
    n_accepted).
    """
    draft = np.asarray(draft_tokens).reshape(-1)  # [k]
    target = np.asarray(target_argmax).reshape(-1)  # [k+1]
    k = draft.size
    if target.size != k + 1:
        raise ValueError(f"target_argmax needs k+1 = {k + 1} entries, got {target.size}")
    if not k:  # a step that drafted nothing (an idle one): the oracle's token
        return target.astype(np.int32), 0
    mismatch = np.flatnonzero(draft != target[:k])
    n_accepted = int(mismatch[0]) if mismatch.size else k
    # the accepted draft tokens equal the oracle's argmax, so the output is a prefix of it
    return target[: n_accepted + 1].astype(np.int32), n_accepted


def accept_draft(
    draft_tokens: np.ndarray,
    draft_probs: np.ndarray | SparseRows | None,
    target_probs: np.ndarray,
    rng: np.random.Generator,
) -> tuple[np.ndarray, int]:
    """Speculative sampling for one sequence.

    draft_tokens [k] int; draft_probs [k, vocab] (an array, or `SparseRows`) or None (point-mass drafts); target_probs
    [k+1, vocab]. Returns (output_tokens [n_accepted+1] int32, n_accepted). See the module
    docstring for the rule and its edge cases.
    """
    draft = np.asarray(draft_tokens).reshape(-1)  # [k]
    if not isinstance(target_probs, LazyProbs):
        target_probs = np.asarray(target_probs)  # [k+1, vocab]
    k = draft.size
    if target_probs.ndim != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs must be [k+1={k + 1}, vocab], got {target_probs.shape}")
    vocab = target_probs.shape[1]
    if draft_probs is not None:
        if not isinstance(draft_probs, SparseRows):
            draft_probs = np.asarray(draft_probs)  # [k, vocab]
        if draft_probs.shape != (k, vocab):
            raise ValueError(f"draft_probs must be [k={k}, vocab={vocab}], got {draft_probs.shape}")
    tokens = draft.tolist()
    if k and not (0 <= min(tokens) and max(tokens) < vocab):
        raise ValueError(f"draft token ids must lie in [0, {vocab})")

    for i, d in enumerate(tokens):
        p_d = target_probs[i, d]
        q_d = 0.0 if draft_probs is None else draft_probs[i, d]
        # q_d == 0: no draft probabilities, or a token the draft could not have proposed;
        # either way a point mass on d (see the module docstring)
        point_mass = q_d <= 0.0
        # accept with probability min(1, p(d) / q(d))
        if rng.random() * (1.0 if point_mass else q_d) < p_d:
            continue
        # rejected: the recovered token comes from normalize(max(0, p - q))
        p = target_probs[i]  # [vocab]
        residual = scratch(vocab, slot="residual")  # [vocab]
        if point_mass:
            residual[...] = p
            residual[d] = 0.0
        else:
            np.maximum(np.subtract(p, draft_probs[i], out=residual), 0.0, out=residual)
        recovered = draw_or_none(residual, rng)
        if recovered is None:  # residual mass 0: p == q up to rounding, rejection had prob ~0
            recovered = sample(p, rng)
        return np.array(tokens[:i] + [recovered], dtype=np.int32), i

    bonus = sample(target_probs[k], rng)  # all k accepted
    return np.array(tokens + [bonus], dtype=np.int32), k


def accept(draft_tokens: np.ndarray, draft_probs: np.ndarray | None, logits: np.ndarray, sampling: SamplingParams,
           rng: np.random.Generator, *, position: int, masks: np.ndarray | None = None,
           picked: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """A step's acceptance, every input handed in: the draft (tokens [k], the distributions
    [k, vocab] they were drawn from, or None for point masses), the oracle's logits over the
    verified rows [k+1, vocab], how the request samples and its generator. The target is the
    oracle as the request asked for it: its logits biased (`sampling.logit_bias`) and, under a
    grammar, each row masked to what the grammar allows at its position (`masks` [k+1, vocab]
    bool; the draft's tokens included). Then the request's regime's rule: greedy (the argmax, or
    `picked` [k+1], the greedy ids llama.cpp already chose on the device: then `logits` is not
    read), seeded (each row's pick with the noise of its `position` onward: the oracle alone's), or
    speculative sampling (`accept_draft`). Returns (output tokens [n_accepted + 1], n_accepted)."""
    if sampling.greedy and picked is not None:
        return accept_greedy(draft_tokens, picked)
    logits = bias_logits(logits, sampling.logit_bias)
    if masks is not None:
        logits = mask_logits(logits, masks)  # [k+1, vocab]
    if sampling.greedy:
        return accept_greedy(draft_tokens, greedy_argmax(logits))  # the target's argmax [k+1]
    target_probs = LazyProbs(logits, sampling)  # [k+1, vocab], each row computed when first read
    if sampling.coupled:
        return accept_coupled(draft_tokens, target_probs, sampling.seed, position)
    return accept_draft(draft_tokens, draft_probs, target_probs, rng)


def accept_coupled(draft_tokens: np.ndarray, target_probs: np.ndarray | LazyProbs, seed: int,
                   position: int) -> tuple[np.ndarray, int]:
    """Seeded sampling's check: `accept_greedy` against the oracle's own seeded pick at each
    verified row of target_probs [k+1, vocab] (`coupled_choice` at position + i), each pick made
    only when the draft has agreed so far."""
    tokens = np.asarray(draft_tokens).reshape(-1).tolist()  # [k]
    k = len(tokens)
    if len(target_probs) != k + 1:
        raise ValueError(f"target_probs needs k+1 = {k + 1} rows, got {len(target_probs)}")
    for i, d in enumerate(tokens):
        pick = coupled_choice(target_probs[i], seed, position + i)
        if pick != d:
            return np.array(tokens[:i] + [pick], dtype=np.int32), i
    return np.array(tokens + [coupled_choice(target_probs[k], seed, position + k)], dtype=np.int32), k
