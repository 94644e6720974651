"""A sampled draft model's distribution: what it draws its tokens from (`proposal_probs`: the
request's distribution less the far tail) and how it hands that on to acceptance (`SparseRows`:
each row's support). Speculative sampling is exact for whatever distribution a draft token was
drawn from, so long as acceptance is handed that one: the draft need not pay for the whole
vocabulary per token (see `proposal_probs`).
"""

from __future__ import annotations

import math

import numpy as np

from localspec.speculative.sampling import SamplingParams, _check_finite_max, logits_to_probs, scratch

# a draft's distribution leaves out the tokens whose logits, over the temperature, lie more than
# log(vocab) + this many nats below the top: together they weigh under e^-3 of it; on the default
# draft's real rows (3 prompts, 300 draft tokens) they weighed 1e-4 (T = 0.7) to 6e-4 (T = 1) at
# the mean and 2e-3 at most, and the rest was a median of 111 (T = 0.7) and 1271 (T = 1) of 49152
PROPOSAL_TAIL_NATS = 3.0


def proposal_probs(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """A sampled draft's distribution: `logits_to_probs` over the tokens within reach of the top
    (see PROPOSAL_TAIL_NATS), none elsewhere. Speculative sampling is exact whatever distribution
    a draft token came from, so long as acceptance is handed that one, so the draft may leave out
    a tail that weighs a ten-thousandth; what it saves is the exp, the copy and the normalisation
    of the whole vocabulary per draft token (~3/4 of a row's cost), and the row itself (see
    `SparseRows`). The price: a draft token is accepted with at most 1 - (the tail's weight), so
    a draft that is the oracle itself is rejected now and then (1 token in 1,500-10,000 on the
    default draft). Where the tail is not most of the row, nothing is left out. logits [vocab]
    (never written). Returns the distribution's support, ids [m] ascending, and its
    probabilities [m]."""
    x = np.asarray(logits).reshape(-1)  # [vocab]
    top = x.max()
    _check_finite_max(top)
    reach = (math.log(x.size) + PROPOSAL_TAIL_NATS) * float(params.temperature)
    ids = np.flatnonzero(x >= top - reach)  # [m]: the top among them
    if 2 * ids.size > x.size:  # most of the row: the whole distribution costs no more, and loses no acceptance
        return np.arange(x.size), logits_to_probs(x, params)
    if params.temperature_only:
        probs = np.exp((x[ids].astype(np.float64) - float(top)) / float(params.temperature))  # [m]
        return ids, probs / probs.sum()
    return ids, logits_to_probs(x[ids], params)


def top_row_proposal(ids: np.ndarray, logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """A sampled draft's distribution where the device kept only its row's k largest logits
    (`batch.TopRow`: `logits` [k] and their `ids` [k], in no order): `logits_to_probs` over those k
    (the request's temperature, top-k, top-p and min-p among them), none elsewhere. Exact as
    `proposal_probs` is: acceptance is handed the distribution the token is drawn from. What it
    leaves out is the row outside the top k (more of it at a high temperature, where a draft token
    is then accepted a little less often). Returns the support, ids [m] ascending, and its
    probabilities [m]."""
    order = np.argsort(ids, kind="stable")  # [k]
    return ids[order], logits_to_probs(logits[order], params)


class SparseRows:
    """Probability rows [n, vocab] held as each row's support (ids ascending) and its weights: a
    sampled draft's distributions (`proposal_probs`; a grammar's forced tokens, one-hot). A dense
    float64 row per draft token cost its writing, 8 bytes a token of the vocabulary: on a 2-core
    Xeon VM 80 us a draft token, 22 MB a step for 8 sequences drafting 7 each. Read as the dense
    array would be: `rows[i, token]` (one probability), `rows[i]` (the row, dense, in this
    thread's kept memory: valid until the next such read), `np.asarray(rows)` (a fresh array).
    `add(ids, probs)` appends a row; `snapshot()` hands out the rows so far, which a later
    `clear()` leaves as they are."""

    ndim = 2

    def __init__(self, width: int) -> None:
        self.width = width
        self.ids: list[np.ndarray] = []  # each row's support [m_i], ascending
        self.probs: list[np.ndarray] = []  # each row's probabilities [m_i]

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.ids), self.width

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, ids: np.ndarray, probs: np.ndarray) -> None:
        self.ids.append(ids)
        self.probs.append(probs)

    def clear(self) -> None:
        self.ids, self.probs = [], []

    def snapshot(self) -> "SparseRows | None":
        """These rows as they are now (None: none)."""
        if not self.ids:
            return None
        rows = SparseRows(self.width)
        rows.ids, rows.probs = list(self.ids), list(self.probs)
        return rows

    def __getitem__(self, key):
        if isinstance(key, tuple):
            i, token = key
            ids = self.ids[i]
            j = int(np.searchsorted(ids, token))
            return float(self.probs[i][j]) if j < ids.size and ids[j] == token else 0.0
        dense = scratch(self.width, slot="sparse row")  # [vocab]
        dense.fill(0.0)
        dense[self.ids[key]] = self.probs[key]
        return dense

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.zeros(self.shape, dtype=np.float64)  # [n, vocab]
        for i, (ids, probs) in enumerate(zip(self.ids, self.probs)):
            out[i, ids] = probs
        return out if dtype is None else out.astype(dtype)
