"""Pure-numpy sampling maths: logits -> filtered probabilities -> a token.

Filter order (``logits_to_probs``)
----------------------------------
1. temperature: ``logits / temperature`` (as in HF transformers and vLLM, before the filters);
2. top-k: keep the ``top_k`` largest logits;
3. top-p: keep the smallest prefix, by descending probability of what top-k left, whose mass
   reaches ``top_p``;
4. min-p: keep tokens whose probability is at least ``min_p`` times the largest one;
5. renormalise over the kept tokens.

Steps 2-4 are llama.cpp's order. Ties are broken deterministically: among equal
probabilities the lower token id ranks first, so top-k keeps exactly ``k`` tokens and top-p
keeps exactly the prefix of the stable order "probability descending, token id ascending".
min-p keeps every token at or above its threshold (ties included).

Greedy (``temperature == 0``) ignores the filters and yields a one-hot at the argmax (first
maximal id on ties), so that the same acceptance code serves greedy and sampled decoding.

Cost: this runs on every verified row (vocab 50k-260k), so nothing sorts a whole vocabulary
unless a filter really needs most of it. Each row goes start to finish while it is in cache;
exp runs in the logits' own precision (float32 from llama.cpp: AVX2 has a SIMD float32 exp
~3x faster than float64's, so probabilities are accurate to ~1e-7 relative), sums and output
in float64. top-k is np.partition plus one compare; top-p sorts only a candidate set (see
``_nucleus``).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from localspec.options import OPTIONS, GenerationOptions

# top-p mass is compared with ``top_p - _TOP_P_TOL`` so that rounding in the sums (a prefix
# whose exact mass is top_p) cannot pull in one more token.
_TOP_P_TOL = 1e-9
# top-p candidate sets: the tokens with p >= t for these t (at most 1/t tokens each), before
# the whole row; rows of at most _TOP_P_DIRECT tokens (e.g. after top-k) are sorted directly.
_TOP_P_THRESHOLDS = (2.0**-10, 2.0**-14, 2.0**-18)
_TOP_P_DIRECT = 1024
# sample(): block size of the two-level inverse CDF
_SAMPLE_BLOCK = 1024


@dataclass(frozen=True)
class SamplingParams:
    """The sampling options (rules and defaults from options.py): 0 temperature is greedy; top_k
    0, top_p 1 and min_p 0 disable their filter; a seed makes sampling reproducible."""

    temperature: float = OPTIONS["temperature"].default
    top_k: int = OPTIONS["top_k"].default
    top_p: float = OPTIONS["top_p"].default
    min_p: float = OPTIONS["min_p"].default
    seed: int | None = OPTIONS["seed"].default
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, added to the logits first

    def __post_init__(self) -> None:
        for name in _FIELDS:  # the rules of options.py
            value = OPTIONS[name].check(getattr(self, name))
            if value != getattr(self, name):
                object.__setattr__(self, name, value)

    @classmethod
    def of(cls, options: GenerationOptions) -> "SamplingParams":
        """The sampling options of `options`, taken as they are: their rules checked them when
        `options` was built (a request's options are checked once)."""
        params = object.__new__(cls)
        for name in _FIELDS:
            object.__setattr__(params, name, getattr(options, name))
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def coupled(self) -> bool:
        """Seeded sampling: each position's token is drawn with noise keyed by (seed, position)
        (see `coupled_choice`), so the output depends on the seed alone, not on the draft length
        (up to near-ties in llama.cpp's batch-size-dependent logits, as with greedy)."""
        return not self.greedy and self.seed is not None

    @property
    def temperature_only(self) -> bool:
        """Sampled at a temperature, with top-k, top-p and min-p all off."""
        return not self.greedy and self.top_k <= 0 and self.top_p >= 1.0 and self.min_p <= 0.0


_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "logit_bias")


def _as_rows(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits)
    if x.ndim not in (1, 2) or x.shape[-1] == 0:
        raise ValueError(f"logits must have shape [vocab] or [n, vocab], got {x.shape}")
    return x.reshape(1, -1) if x.ndim == 1 else x


def _check_finite_max(m: np.ndarray) -> None:
    if not (math.isfinite(m) if np.ndim(m) == 0 else np.all(np.isfinite(m))):
        raise ValueError("every row of logits needs a finite maximum (got a row that is all -inf, or has +inf/NaN)")


def greedy_argmax(logits: np.ndarray) -> np.ndarray:
    """The greedy token of each row: logits [n, vocab] -> [n] int (or [vocab] -> a numpy integer),
    the first maximal id on ties. Raises the sampled paths' ValueError for a row without a finite
    maximum: numpy's argmax returns the index of the first NaN, so a NaN anywhere in a row shows
    up at its argmax, as do +inf and an all -inf row. O(vocab), one check per row."""
    if np.ndim(logits) == 1 and len(logits):  # one row (a draft token): no fancy indexing
        best = np.argmax(logits)
        _check_finite_max(logits[best])
        return best
    x = _as_rows(logits)  # [n, vocab]
    best = np.argmax(x, axis=1)  # [n]
    _check_finite_max(x[np.arange(x.shape[0]), best])
    return best.reshape(np.shape(logits)[:-1])


def _top_k_ids(x: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest entries of the row x [vocab] (ties: lower id first), ascending. O(vocab).

    Top-k commutes with temperature (T > 0), so it runs on the raw logits.
    """
    v = x.size
    tail = np.partition(x, v - k)[v - k :]  # the k largest values (NaN would sort last, into here)
    _check_finite_max(tail.max())
    kth = tail[0]  # the k-th largest value
    ids = np.flatnonzero(x >= kth)  # ascending
    if ids.size > k:  # the k-th value is tied: keep the lowest ids among the ties
        above = ids[x[ids] > kth]
        tied = ids[x[ids] == kth][: k - above.size]
        ids = np.sort(np.concatenate((above, tied)))
    return ids


def top_ids(values: np.ndarray, n: int) -> np.ndarray:
    """Ids of the n largest entries of values [vocab], largest first, in a stable order: among
    equal values the lower id makes the cut and comes first. O(vocab + n log n)."""
    n = min(n, values.size)
    if n <= 0:
        return np.zeros(0, dtype=np.intp)
    ids = _top_k_ids(values, n)  # [n] ascending
    return ids[np.argsort(-values[ids], kind="stable")]


def _nucleus(p: np.ndarray, top_p: float | None, min_p: float | None) -> np.ndarray:
    """Positions in p [m] (normalised) kept by top-p, then min-p; either may be None (off).

    top-p keeps the smallest prefix of the order (p descending, position ascending) whose mass
    reaches top_p; min-p then keeps those with p >= min_p * max(p). Both are prefixes of the
    same order, so the result is the shorter of the two.

    Only a candidate set {p >= t} is sorted, never the whole row unless needed. It has at most
    1/t members (p sums to 1), costs one O(m) compare (cheaper than an argpartition) and holds
    every value >= t, so it is a prefix of the sorted order with its ties. With min-p, t is the
    min-p floor: if those tokens hold less than top_p of the mass, top-p keeps all of them (and
    more) and min-p cuts back to exactly them. Otherwise t = 2**-10, 2**-14, 2**-18, then all of
    p, the first set that holds top_p of the mass; a stage is skipped outright when even 1/t
    tokens of probability max(p) could not reach top_p.
    """
    p_max = p.max()
    floor = min_p * p_max if min_p is not None else 0.0
    if top_p is None:
        return np.flatnonzero(p >= floor)
    target = top_p - _TOP_P_TOL
    cand = None  # positions of the candidates; None = all of p
    if floor > 0.0:
        cand = np.flatnonzero(p >= floor)
        if p[cand].sum() < target:
            return cand
    elif p.size > _TOP_P_DIRECT:
        for t in _TOP_P_THRESHOLDS:
            if p_max < target * t:
                continue
            c = np.flatnonzero(p >= t)
            if p[c].sum() >= target:
                cand = c
                break
    pc = p if cand is None else p[cand]  # [c], positions ascending
    desc = np.sort(pc)[::-1]  # values only: a value sort is far cheaper than an argsort
    cum = np.cumsum(desc)
    n = min(int(np.searchsorted(cum, target, side="left")) + 1, desc.size)
    # keep exactly n: everything above the n-th largest value, then the lowest positions
    # among the entries equal to it (all of which are candidates)
    cut = desc[n - 1]
    above = np.flatnonzero(pc > cut)  # fewer than n
    tied = np.flatnonzero(pc == cut)[: n - above.size]
    keep = np.concatenate((above, tied))
    return keep if cand is None else cand[keep]


def _exp_dtype(x: np.ndarray, temperature: float) -> np.dtype:
    """exp runs in the logits' own precision, at least float32 (llama.cpp's float32 logits get
    AVX2's SIMD float32 exp, ~3x faster than float64's); float64 for a temperature so small
    that float32 cannot represent it."""
    ftype = np.result_type(x.dtype, np.float32)
    if not ftype.type(temperature) > 0:
        ftype = np.dtype(np.float64)
    return ftype


_scratch = threading.local()  # each thread's working memory (`scratch`)
SCRATCH_KEEP_BYTES = 64 * 2**20  # a slot keeps at most this much (17 rows of a 262k vocabulary take 36 MB)


def scratch(shape: int | tuple[int, ...], dtype=np.float64, *, slot: str = "") -> np.ndarray:
    """An array of `shape`, uninitialised, from memory this thread keeps from call to call (one
    per `slot` and dtype, grown as needed, up to SCRATCH_KEEP_BYTES; a larger one is fresh): its
    contents last until the slot's next use. A fresh array of a vocabulary's size is mapped anew by
    the allocator each time and costs its page faults: on a 2-core Xeon VM, 8 fresh 49k rows cost
    780 us a row to fill against 190 us in reused memory."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    size = math.prod(shape)
    dtype = np.dtype(dtype)
    if size * dtype.itemsize > SCRATCH_KEEP_BYTES:
        return np.empty(shape, dtype)
    pool = _scratch.__dict__.setdefault("pool", {})
    buf = pool.get((slot, dtype))
    if buf is None or buf.size < size:
        grown = max(size, min(2 * (buf.size if buf is not None else 0), SCRATCH_KEEP_BYTES // dtype.itemsize))
        buf = pool[(slot, dtype)] = np.empty(grown, dtype)
    return buf[:size].reshape(shape)


def _exp_shifted(x: np.ndarray, temperature: float, ftype: np.dtype) -> np.ndarray:
    """exp((x - max x) / temperature) [vocab] in `ftype`, in this thread's kept memory (valid until
    the next call). Never writes x."""
    m = x.max()
    _check_finite_max(m)
    t = np.subtract(x, m, out=scratch(x.shape, ftype, slot="softmax"), dtype=ftype)  # [vocab]
    if temperature != 1.0:
        t /= ftype.type(temperature)
    return np.exp(t, out=t)


def _softmax_into(x: np.ndarray, temperature: float, ftype: np.dtype, out: np.ndarray) -> None:
    """out [vocab] float64 <- softmax(x / temperature), x [vocab]. Never writes x."""
    out[...] = _exp_shifted(x, temperature, ftype)
    out /= out.sum()


def top_probability(row: np.ndarray, token: int) -> float:
    """softmax(row)[token] for the row's maximal `token`, row [vocab] (a greedy draft's confidence):
    exp in the row's precision, at least float32 (row - row[token] <= 0 cannot overflow; what
    underflows adds nothing), the sum in float64. ~45 us for 49k logits, against ~380 us in float64:
    it runs once per drafted token."""
    shifted = np.subtract(row, row[token], dtype=np.result_type(row.dtype, np.float32))  # [vocab], <= 0
    return 1.0 / float(np.exp(shifted, out=shifted).sum(dtype=np.float64))


_FAR_MARGIN = 2.2  # nats beyond log(vocab): the logits that far below the top add at most e^-2.2 ~ 0.11 to S


def top_probability_at_least(row: np.ndarray, token: int, p_min: float) -> bool:
    """Whether softmax(row)[token] >= p_min, for the row's maximal `token` (a greedy draft's
    confidence floor), without an exp over the whole row where the answer is already certain.

    softmax(row)[token] = 1 / S with S = sum(exp(row - row[token])). The logits within
    c = log(vocab) + 2.2 nats of the top ("near": a few hundred of 49k in a real draft's row) are
    summed exactly; each of the rest adds less than e^-c, together less than e^-2.2. S is then
    known within [near, near + far bound]: when 1/p_min is outside that interval the answer is
    exact; otherwise (rare: <1% of real rows) the whole row is summed as `top_probability` does."""
    top = row[token]
    margin = math.log(row.size) + _FAR_MARGIN
    near = row[row >= top - margin]  # [m], m << vocab on a real row
    s = float(np.exp(np.subtract(near, top, dtype=np.result_type(row.dtype, np.float32))).sum(dtype=np.float64))
    limit = 1.0 / p_min
    if s > limit:
        return False
    if s + (row.size - near.size) * math.exp(-margin) <= limit:
        return True
    return top_probability(row, token) >= p_min


def top_row_greedy(ids: np.ndarray, logits: np.ndarray, p_min: float) -> tuple[int, bool]:
    """A greedy draft's token and whether it clears the confidence floor `p_min`, from its row's k
    largest logits `logits` [k] and their `ids` [k] (in no order: a device's top-k, `batch.TopRow`):
    the id of the largest (the lowest id on a tie, as `greedy_argmax`), the same token the whole
    row gives. Its probability is taken over those k: at least its probability over the whole
    vocabulary (the rest of the row is left out of the sum), so the floor lets a draft go on where
    the weight outside the top k would have stopped it. With k = 256 on the default draft's real
    rows (SmolLM2 Q4_1 and Q2_K, ~800 rows each) the two agreed on 99.4% of rows at p_min 0.3.
    The floor only decides how long a draft runs, never what is accepted."""
    top = logits.max()
    _check_finite_max(top)
    token = int(ids[logits == top].min())
    if p_min <= 0:
        return token, True
    total = float(np.exp(logits.astype(np.float64) - float(top)).sum())
    return token, 1.0 / total >= p_min


def logits_to_probs(logits: np.ndarray, params: SamplingParams, *, out: np.ndarray | None = None) -> np.ndarray:
    """logits: [n, vocab] or [vocab], any real dtype; never written to (read-only views are fine).

    Returns float64 probabilities of the same shape: temperature, then top-k, top-p, min-p (see
    the module docstring), renormalised. Tokens whose logit is -inf get probability 0. Greedy
    params give a one-hot at the argmax. Raises ValueError for a row without a finite maximum
    (all -inf, or +inf/NaN present). `out`: a float64 array of the logits' shape to write them
    into (kept memory: see `scratch`), returned.

    Rows are processed one at a time, start to finish: the working set of a row stays in
    cache, which measured over 2x faster than whole-array passes over [17, 49152].
    """
    shape = np.shape(logits)
    x = _as_rows(logits)  # [n, vocab]
    n, vocab = x.shape
    if out is not None:
        if out.shape != shape or out.dtype != np.float64:
            raise ValueError(f"out must be float64 of the logits' shape {shape}, got {out.dtype} {out.shape}")
        result, out = out, out.reshape(n, vocab)
    else:
        result = None
    if params.greedy:
        out = _zeros_into(out, n, vocab)
        out[np.arange(n), greedy_argmax(x)] = 1.0
        return out.reshape(shape) if result is None else result

    temperature = float(params.temperature)
    top_k = int(params.top_k) if 0 < params.top_k < vocab else 0
    top_p = float(params.top_p) if params.top_p < 1.0 else None
    min_p = float(params.min_p) if params.min_p > 0.0 else None
    ftype = _exp_dtype(x, temperature)

    # top-k rows are sparse: start from zeros and write the k kept entries
    if top_k:
        out = _zeros_into(out, n, vocab)
    elif out is None:
        out = np.empty((n, vocab), dtype=np.float64)
    for r in range(n):
        if top_k:
            ids = _top_k_ids(x[r], top_k)  # [k] token ids, ascending
            p = np.empty(ids.size, dtype=np.float64)  # [k]
            _softmax_into(x[r, ids], temperature, np.dtype(np.float64), p)  # small: float64 exp
        else:
            ids = None  # positions in p are token ids
            p = out[r]  # [vocab], a view: written in place
            _softmax_into(x[r], temperature, ftype, p)
        if top_p is None and min_p is None:
            if ids is not None:
                out[r, ids] = p
            continue
        keep = _nucleus(p, top_p, min_p)  # positions in p
        p_keep = p[keep]  # [kept], a copy
        p_keep /= p_keep.sum()
        if ids is None:
            p.fill(0.0)
            p[keep] = p_keep
        else:
            out[r, ids[keep]] = p_keep
    return out.reshape(shape) if result is None else result


def _zeros_into(out: np.ndarray | None, n: int, vocab: int) -> np.ndarray:
    if out is None:
        return np.zeros((n, vocab), dtype=np.float64)
    out.fill(0.0)
    return out


class LazyProbs:
    """`logits_to_probs(logits, params)` [n, vocab], each row computed when it is first read, into
    this thread's kept memory (`scratch`; valid until the next LazyProbs is read): speculative
    sampling reads the oracle's rows only up to its first rejection, and a seeded check stops at
    its first disagreement. Indexed as the array would be: `rows[i]` (a row), `rows[i, token]`
    (one probability). Under the temperature alone, one probability of a row not yet read whole
    is its exp over the row's sum and nothing more is written: an accepted draft token's test
    needs no more of its row (on a 2-core Xeon VM, in the engine, ~400 us a whole row against
    ~270 for one probability)."""

    ndim = 2

    def __init__(self, logits: np.ndarray, params: SamplingParams) -> None:
        self.logits = _as_rows(logits)  # [n, vocab]
        self.params = params
        self.shape = self.logits.shape
        self._rows = scratch(self.shape, slot="target")  # [n, vocab]
        self._done = [False] * self.shape[0]  # each row: computed whole

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        i = key[0] if isinstance(key, tuple) else key
        if not 0 <= i < self.shape[0]:
            raise IndexError(f"row {i} of {self.shape[0]}")
        if not self._done[i]:
            if self.params.temperature_only and isinstance(key, tuple):
                return self._one(i, key[1])
            logits_to_probs(self.logits[i], self.params, out=self._rows[i])
            self._done[i] = True
        return self._rows[key]

    def _one(self, i: int, token: int) -> float:
        """softmax(logits[i] / temperature)[token], as the whole row computes it (up to the sum's
        rounding)."""
        x = self.logits[i]  # [vocab]
        temperature = float(self.params.temperature)
        e = _exp_shifted(x, temperature, _exp_dtype(x, temperature))  # [vocab]
        return float(e[token]) / float(e.sum(dtype=np.float64))


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw a token id from probs [vocab] (non-negative weights; need not be normalised).

    Inverse CDF with exactly one ``rng.random()`` call, so the generator state fully determines
    the draw. Tokens of weight 0 are never drawn. Raises ValueError if the weights sum to 0.
    """
    token = draw_or_none(probs, rng)
    if token is None:
        raise ValueError("cannot sample: the weights sum to 0 (or are not finite)")
    return token


def draw_or_none(weights: np.ndarray, rng: np.random.Generator) -> int | None:
    """``sample``, but None (and no rng call) when the weights sum to 0 or are not finite.

    Above _SAMPLE_BLOCK tokens the inverse CDF has two levels: block sums locate the block,
    a cumsum inside it the token. That is the same draw as one cumsum over the vocabulary (up
    to rounding), and ~5x faster, as a long cumsum costs ~15x a sum.
    """
    w = np.asarray(weights)  # [vocab]
    blocked = w.size > _SAMPLE_BLOCK
    if blocked:
        full = w.size - w.size % _SAMPLE_BLOCK
        sums = w[:full].reshape(-1, _SAMPLE_BLOCK).sum(axis=1, dtype=np.float64)  # [blocks]
        if full < w.size:
            sums = np.append(sums, w[full:].sum(dtype=np.float64))
    else:
        sums = w
    cdf = np.cumsum(sums, dtype=np.float64)  # [blocks] or [vocab]
    total = float(cdf[-1])
    if not 0.0 < total < math.inf:
        return None
    u = rng.random() * total
    i = _search(cdf, u, sums)
    if not blocked:
        return i
    start = i * _SAMPLE_BLOCK
    block = w[start : start + _SAMPLE_BLOCK]
    u -= cdf[i - 1] if i else 0.0
    return start + _search(np.cumsum(block, dtype=np.float64), u, block)


def _search(cdf: np.ndarray, u: float, w: np.ndarray) -> int:
    """The first index with cdf > u, so never one of weight 0; if rounding put u at or past
    the end, the last index of weight > 0."""
    i = int(cdf.searchsorted(u, side="right"))
    if i >= cdf.size:
        i = int(np.flatnonzero(w > 0)[-1])
    return i


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Raw model log-probabilities (no temperature, no filters): [n, vocab] or [vocab] -> float64
    of the same shape. -inf logits give -inf."""
    shape = np.shape(logits)
    x = _as_rows(logits)  # [n, vocab]
    ftype = _exp_dtype(x, 1.0)
    out = np.empty(x.shape, dtype=np.float64)  # [n, vocab]
    for r in range(x.shape[0]):
        m = x[r].max()
        _check_finite_max(m)
        o = out[r]
        np.subtract(x[r], m, out=o, dtype=np.float64)
        # the sum of exp only sets the normaliser: the logits' precision is enough for it
        lse = math.log(float(np.exp(o.astype(ftype)).sum(dtype=np.float64)))
        o -= lse
    return out.reshape(shape)


# ---------------------------------------------------------------- seeded (coupled) sampling
#
# Gumbel-max: argmax_x(log probs[x] + G[x]) with G[x] i.i.d. standard Gumbel is an exact draw from
# probs. Keying the noise G by (seed, position) makes the token at each position a function of the
# seed and that position's distribution only. The draft picks its token with the same noise, and the
# verifier accepts it iff the oracle's own Gumbel-max pick is the same token, exactly like greedy
# verification: the output is an exact sample from the oracle, identical for any draft, any draft
# length, or none at all, given the same logits. (llama.cpp's logits vary very slightly with the size
# of the batch that computed them, so on a near-tie of two noisy scores another draft length can
# rarely pick the other token, as greedy can; see the README.) (Unseeded sampling uses speculative
# sampling in acceptance.py, which accepts more often but ties the output to the draft's choices.)


def seed_key(seed: int) -> int:
    """Any integer seed (the OpenAI API allows negative ones) as the non-negative one numpy takes."""
    return seed & 0xFFFFFFFFFFFFFFFF


# Noise rows are regenerated on demand (a row is a pure function of seed, position and vocabulary, so
# what the cache keeps never changes an output) and the most recent ones are kept, up to this many
# bytes: each position is used twice in a step (the draft's pick, then the oracle's), and a rejected
# position's row comes back in the next step. 32 MiB holds 27 rows at 152k tokens (a 16-token step
# needs 17), 85 at SmolLM2's 49k; the cache used to hold 256 rows whatever their size (~311 MB at 152k).
NOISE_CACHE_BYTES = 32 * 2**20

_noise_rows: OrderedDict[tuple[int, int, int], np.ndarray] = OrderedDict()  # least recently used first
_noise_bytes = 0
_noise_lock = threading.Lock()


def gumbel_noise(seed: int, position: int, vocab: int) -> np.ndarray:
    """[vocab] standard Gumbel noise for one position of one seeded generation (read-only)."""
    global _noise_bytes
    key = (seed, position, vocab)
    with _noise_lock:
        noise = _noise_rows.get(key)
        if noise is not None:
            _noise_rows.move_to_end(key)
            return noise
    noise = np.random.default_rng((seed_key(seed), position)).gumbel(size=vocab)  # [vocab] float64
    noise.flags.writeable = False
    with _noise_lock:
        if key not in _noise_rows and noise.nbytes <= NOISE_CACHE_BYTES:
            _noise_rows[key] = noise
            _noise_bytes += noise.nbytes
            while _noise_bytes > NOISE_CACHE_BYTES:
                _noise_bytes -= _noise_rows.popitem(last=False)[1].nbytes
    return noise


def coupled_choice(probs: np.ndarray, seed: int, position: int) -> int:
    """The token at `position` for this seed: argmax(log probs + noise), never a 0-probability token."""
    with np.errstate(divide="ignore"):
        scores = np.log(probs, out=scratch(probs.shape, slot="coupled"))  # [vocab]
    scores += gumbel_noise(seed, position, probs.shape[-1])
    return int(np.argmax(scores))


# ---------------------------------------------------------------- constrained decoding


def bias_logits(logits: np.ndarray, logit_bias: tuple[tuple[int, float], ...]) -> np.ndarray:
    """logits [n, vocab] or [vocab] with `logit_bias` ((token id, bias) pairs) added (a new array
    when there is a bias; the logits are not written): OpenAI's logit_bias, applied before a
    grammar's mask, the temperature and the filters."""
    if not logit_bias:
        return logits
    ids, bias = zip(*logit_bias)
    out = np.array(logits, copy=True)
    out[..., list(ids)] += np.asarray(bias, dtype=out.dtype)
    return out


def mask_logits(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """logits [n, vocab] or [vocab] with every token `allowed` [same shape, bool] forbids set to
    -inf (a new array; the logits are not written): a grammar's constraint, applied before
    temperature and the filters, so that they work on the constrained distribution."""
    x = np.asarray(logits)
    if np.shape(allowed) != x.shape:
        raise ValueError(f"the mask's shape {np.shape(allowed)} is not the logits' {x.shape}")
    return np.where(allowed, x, np.float32(-np.inf)).astype(x.dtype, copy=False)
