"""Measuring both models' passes at load, where they cost milliseconds (a GPU), before any request.

On a CPU the policy learns the costs from its first steps: a pass costs tens of milliseconds there,
and a handful of timed decodes at start-up would cost a one-shot `generate` more than it saves. On
a GPU a pass costs 1-10 ms, and its shape is not a CPU's: a one-token pass runs as a CUDA graph of
matrix-vector kernels and a pass of two or more tokens costs 2-3x as much, and a small draft may
cost as much as its oracle (the default pair on an H200: oracle 1.2 ms a token, 3.1 ms for two,
4.4 ms for 17; draft 1.4-1.8 ms a token). A fresh process that learned this from its steps drafted
at a loss until it had (`../shared/gpu/`); a few dozen decodes here, tens of milliseconds, let
the first request's first step know.

`calibrate(policy, verify=..., draft=...)` feeds a learning policy what the timers measured;
`measure(policy, oracle, draft)` builds the timers over an engine's contexts (sequence 0, left empty
after).
The replay (`localspec.bench.replay`) feeds the same function from its cost tables.

The engine runs these decodes on a thread that ends with them (`on_a_passing_thread`), not on the
thread that will generate: see there.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

import numpy as np

from localspec.speculative.policy import LengthPolicy, learns
from localspec.batch import TopRow
from localspec.speculative.sampling import greedy_argmax, top_probability_at_least, top_row_greedy

VERIFY_SIZES = (1, 2, 5, 9, 17)  # oracle passes timed: a plain step, then verify passes of 1-16 drafted tokens
DRAFT_LENGTHS = (1, 4, 8)  # draft proposals timed (a catch-up of two tokens, then a decode a token)
BATCH_SIZES = (1, 2, 5)  # with several sequences: passes of this many tokens of each
ROUND_SIZES = (1, 2)  # ... and the draft's rounds
CONTEXT = 64  # tokens each pass attends to (a short prompt's)
ROUNDS = 2  # the first round warms up (CUDA graphs, kernels chosen per shape), the last is kept

Timer = Callable[[int], float]  # size -> seconds
T = TypeVar("T")


def on_a_passing_thread(fn: Callable[[], T]) -> T:
    """`fn()` on a thread of its own that ends when it returns (its exception raised here).

    llama.cpp's CPU backend, built with OpenMP (llama-cpp-python's is), gives every thread that
    decodes a pool of worker threads, kept until that thread ends. Once the pools' threads outnumber
    the cores, libgomp stops spinning at its barriers (its throttled spin count) and its workers
    sleep between the graph's nodes, so every later decode, on any thread, pays their wake-ups: on
    the 2-core VM a prompt pass took 95-101 ms on one thread after another had decoded, against 80
    on either alone. Decodes at load run here, so that the thread that generates (the server's
    worker, the command line's main thread) is left the process's only pool."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="localspec-load-timing") as pool:
        return pool.submit(fn).result()  # (leaving the block joins the thread)


def calibrate(policy: LengthPolicy, *, verify: Timer | None, draft: Timer | None = None,
              batch: tuple[int, Timer, Timer | None] | None = None, context: int = CONTEXT) -> None:
    """Teach `policy` (a `Learning` one; others are left alone) what the timers measure:
    `verify(n)`, an oracle pass of n tokens; `draft(k)`, a draft proposal of k tokens (it evaluates
    k + 1: a catch-up of two, then one a token); `batch` = (S, verify(n), draft_round(n)) for a
    context of S sequences, a pass of n tokens of each of them."""
    if not learns(policy):
        return
    for n in VERIFY_SIZES if verify is not None else ():
        policy.observe_pass([([n], [context])], verify(n))
    for k in DRAFT_LENGTHS if draft is not None else ():
        policy.observe_draft(k + 1, context, draft(k))
    if batch is not None:
        sequences, verify_batch, draft_round = batch
        for n in BATCH_SIZES:
            policy.observe_pass([([n] * sequences, [context] * sequences)], verify_batch(n))
        for n in ROUND_SIZES if draft_round is not None else ():
            policy.observe_draft_round([([n] * sequences, [context] * sequences)], draft_round(n))


def measure(policy: LengthPolicy, oracle, draft=None, *, backend_sampling: bool = False, draft_top: int = 0,
            context: int = CONTEXT) -> None:
    """Time an engine's `oracle` and `draft` contexts on filler text at sequence 0 (and all their
    sequences, for a batch) and `calibrate` its `policy` from that: the costs it has not learned yet
    (none kept from an earlier process). `backend_sampling`: a verify pass's picks are llama.cpp's
    (`LlamaContext.sample_greedy`), as a greedy request's are; `draft_top`: the draft's rows are
    their top k (`LlamaContext.sample_top`), as a request's are. Leaves every sequence empty."""
    if not learns(policy):
        return
    needs_verify, needs_draft = policy.needs_costs()
    needs_draft = needs_draft and draft is not None
    if not (needs_verify or needs_draft):
        return
    contexts = [oracle] + ([draft] if draft is not None else [])
    n_vocab = min(ctx.n_vocab for ctx in contexts)
    filler = np.random.default_rng(0).integers(2, n_vocab, size=context + max(VERIFY_SIZES) + 1).tolist()
    sequences = min(ctx.n_seq for ctx in contexts)
    greedy = backend_sampling and oracle.sample_greedy(0, True)  # a verify pass's reads, as a request's
    tops = [seq for seq in range(draft.n_seq) if draft.sample_top(seq, draft_top)] if draft_top and needs_draft else []
    try:  # each timer set up right before its rounds (they share sequence 0 of a context)
        verify = _measured(_timer(oracle, filler, context), VERIFY_SIZES) if needs_verify else None
        proposal = _measured(_draft_timer(draft, filler, context), DRAFT_LENGTHS) if needs_draft else None
        batch = None
        if sequences > 1 and needs_verify:
            batch = (sequences, _measured(_batch_timer(oracle, filler, context, sequences), BATCH_SIZES),
                     _measured(_batch_timer(draft, filler, context, sequences), ROUND_SIZES) if needs_draft else None)
    finally:
        if greedy:
            oracle.sample_greedy(0, False)
        for seq in tops:
            draft.sample_top(seq)
        for ctx in contexts:
            ctx.reset()
    calibrate(policy, verify=verify, draft=proposal, batch=batch, context=context)


PICKS_LENGTH, PICKS_ROUNDS = 4, 3  # draft proposals timed each way for `draft_picks_faster`


def draft_picks_faster(draft, k: int, *, context: int = CONTEXT) -> tuple[bool, dict[str, float]]:
    """Whether the `draft` context's proposals run faster with each row's top `k` kept on the
    device (`LlamaContext.sample_top`) than with its whole rows read on the host, each way timed
    over proposals of PICKS_LENGTH tokens, picks included (the first round of each a warm-up: the
    graph is re-planned, a CUDA graph captured again). Where the draft runs on a GPU the top-k
    saves reading the vocabulary's logits per drafted token; a backend whose graph ran it slowly,
    or stopped running the draft's decodes as one CUDA graph, keeps whole rows. A few dozen
    decodes. Returns the answer and the seconds a proposal took each way ("whole", "top")."""
    filler = np.random.default_rng(0).integers(2, draft.n_vocab, size=context + PICKS_LENGTH + 1).tolist()
    seconds = {}
    try:
        timer = _draft_timer(draft, filler, context)
        for name, top in (("whole", 0), ("top", k)):
            if top and not draft.sample_top(0, top):
                return False, seconds
            seconds[name] = min([timer(PICKS_LENGTH) for _ in range(PICKS_ROUNDS)][1:])
    finally:
        draft.sample_top(0)
        draft.reset()
    return seconds["top"] < seconds["whole"], seconds


def _measured(timer: Timer, sizes: Sequence[int]) -> Timer:
    """Every size timed round by round (the first round a warm-up), the best of the rest kept."""
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(ROUNDS):
        for n in sizes:
            times[n].append(timer(n))
    return lambda n: _best(times[n])


def _best(times: Sequence[float]) -> float:
    return min(times[ROUNDS // 2:] or times)


def _timer(ctx, filler: list[int], context: int) -> Timer:
    """An oracle pass of n tokens after `context` tokens of filler, its logits (or the backend's
    picks) read as a verify pass reads them."""
    ctx.rollback(0)
    ctx.decode(filler[:context], n_logits=0)

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        ctx.decode(filler[context:context + n], n_logits=n)
        seconds = time.perf_counter() - t0
        ctx.rollback(context)
        return seconds

    return timed


def _draft_timer(ctx, filler: list[int], context: int) -> Timer:
    """A draft proposal of k tokens as the draft model proposes: a catch-up of two tokens, then one
    decode a drafted token but the last, each row picked from on the host (its top k, where the
    device kept that: `TopRow`)."""
    ctx.rollback(0)
    ctx.decode(filler[:context - 2], n_logits=0)

    def timed(k: int) -> float:
        t0 = time.perf_counter()
        logits = ctx.decode(filler[context - 2:context], n_logits=1)
        for i in range(k):
            row = logits[0]
            if isinstance(row, TopRow):
                top_row_greedy(row.ids, row.logits, 0.3)
            else:
                token = int(greedy_argmax(row))
                top_probability_at_least(row, token, 0.3)
            if i < k - 1:
                logits = ctx.decode([filler[context + i]], n_logits=1)
        seconds = time.perf_counter() - t0
        ctx.rollback(context - 2)
        return seconds

    return timed


def _batch_timer(ctx, filler: list[int], context: int, sequences: int) -> Timer:
    """A pass of n tokens of each of `sequences` sequences, each after `context` tokens of filler."""
    from localspec.batch import Rows

    ctx.rollback(0)
    ctx.decode(filler[:context], n_logits=0)
    for seq in range(1, sequences):
        ctx.copy_seq(0, seq, context)

    def timed(n: int) -> float:
        rows = [Rows(seq, filler[context:context + n], n) for seq in range(sequences)]
        t0 = time.perf_counter()
        ctx.decode_rows(rows)
        seconds = time.perf_counter() - t0
        for seq in range(sequences):
            ctx.rollback(context, seq=seq)
        return seconds

    return timed
