"""Many sequences at once (localspec.runtime.scheduler, localspec.runtime.sequence, Engine.step) over scripted
contexts: each sequence gets exactly what it would get alone, whatever else runs beside it; requests
join and leave at step boundaries; long prompts fill in chunks beside running streams; an abort
frees its slot within one step; a prefix another slot holds is copied, not evaluated."""

from __future__ import annotations

import numpy as np
import pytest

from localspec.runtime.engine import Request
from localspec.speculative.policy import FixedLength
from localspec.speculative.sampling import SamplingParams
from localspec.runtime.sequence import Status
from test_engine_scripted import (KINDS, M, N_SAMPLES, PROMPT, T1, chi_square, first_tokens_distribution,  # noqa: F401
                                  fixed_entropy,
                                  outcome_probability, proposer_engine)

PROMPTS = ("bcat.dfg,bcat.dfg,", "the cat, the hat.", "abcabcab", "xyz zyx xyz", "hello, hello, he",
           "a.b.c.d.e.f", "then the thin", "dfg,bcat.")


def prompt_tokens(engine, i: int) -> list[int]:
    return engine.oracle_model.tokenize(PROMPTS[i % len(PROMPTS)])


def run_all(engine, requests: list[tuple[list[int], Request]]) -> list:
    """Add every request to the engine's scheduler at once and step until all are done."""
    seqs = [engine.scheduler.add(engine.new_seq(tokens, request)) for tokens, request in requests]
    for _ in range(10_000):
        if not engine.scheduler.has_work:
            break
        engine.scheduler.step()
    assert all(s.done for s in seqs)
    return seqs


def alone(kind: str, tokens: list[int], request: Request) -> list[int]:
    engine = proposer_engine(kind)
    return [t for c in engine.stream_tokens(tokens, request) for t in c.tokens]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_sequences_run_together_get_exactly_what_each_would_alone(kind, mode):
    """Six requests on four slots (two wait, then join as others leave): each one's tokens are the
    ones it gets alone, and the oracle's passes carried several sequences."""
    engine = proposer_engine(kind, parallel=4)
    requests = [(prompt_tokens(engine, i),
                 Request(max_tokens=8 + 5 * i, sampling=SamplingParams(temperature=1.0, seed=i) if mode == "seeded"
                         else SamplingParams()))
                for i in range(6)]
    seqs = run_all(engine, requests)
    for seq, (tokens, request) in zip(seqs, requests):
        assert seq.status == Status.FINISHED and seq.completion_tokens == alone(kind, tokens, request)
    assert max(len(rows) for rows in engine.oracle.passes) == 4  # four sequences in one pass
    assert sum(s.stats.drafted for s in seqs) > 0


@pytest.mark.parametrize("kind", ["draft40", "lookup", "hybrid"])
def test_sampled_sequences_in_a_batch_follow_the_oracle_alones_distribution(kind, fixed_entropy):
    """The first M tokens of N_SAMPLES sampled requests run eight at a time: distributed as the
    oracle alone's, each sequence drawing from its own generator."""
    engine = proposer_engine(kind, parallel=8)
    logits = engine.oracle.logits
    prompt = engine.oracle_model.tokenize(PROMPT)
    expected = first_tokens_distribution(logits, prompt, T1)
    seqs = run_all(engine, [(prompt, Request(max_tokens=M, sampling=T1)) for _ in range(N_SAMPLES)])
    counts: dict[tuple, int] = {}
    for s in seqs:
        outcome = tuple(s.completion_tokens) + ((1,) if s.finish_reason == "stop" and len(s.completion_tokens) < M else ())
        assert outcome_probability(logits, prompt, T1, outcome) > 0, outcome
        counts[outcome] = counts.get(outcome, 0) + 1
    stat, critical = chi_square(counts, expected, N_SAMPLES)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"
    assert max(len(rows) for rows in engine.oracle.passes) == 8


def test_a_seeded_request_does_not_depend_on_what_runs_beside_it():
    request = Request(max_tokens=20, sampling=SamplingParams(temperature=1.0, seed=7))
    engine = proposer_engine("draft40", parallel=4)
    tokens = prompt_tokens(engine, 0)
    others = [(prompt_tokens(engine, i), Request(max_tokens=15, sampling=SamplingParams(temperature=0.9)))
              for i in (1, 2, 3)]
    seqs = run_all(engine, others[:2] + [(tokens, request)] + others[2:])
    assert seqs[2].completion_tokens == alone("draft40", tokens, request)


def test_a_long_prompt_fills_in_chunks_while_another_streams():
    """A 200-token prompt arriving while a request streams: each pass carries at most prefill_chunk
    of it, and the running request emits a token in every one of those passes."""
    engine = proposer_engine("lookup", parallel=2)
    engine.policy = FixedLength(0)
    engine.scheduler.prefill_chunk = 32
    first = engine.scheduler.add(engine.new_seq(prompt_tokens(engine, 0), Request(max_tokens=40)))
    engine.scheduler.step()
    engine.scheduler.step()
    long_prompt = engine.oracle_model.tokenize("the cat sat. " * 16)
    assert len(long_prompt) > 150
    second = engine.scheduler.add(engine.new_seq(long_prompt, Request(max_tokens=4)))
    passes_before = len(engine.oracle.passes)
    emitted = []
    while second.status != Status.RUNNING:
        n = first.stats.completion_tokens
        engine.scheduler.step()
        emitted.append(first.stats.completion_tokens - n)
    chunk_passes = engine.oracle.passes[passes_before:]
    assert len(chunk_passes) >= len(long_prompt) // 32
    assert all(n <= 32 for rows in chunk_passes for seq, n in rows if seq == second.slot)
    assert all(e == 1 for e in emitted)  # streaming went on in every pass
    while engine.scheduler.has_work:
        engine.scheduler.step()
    assert second.completion_tokens == alone("lookup", long_prompt, Request(max_tokens=4, speculative=False))


def test_an_abort_frees_its_slot_for_the_next_request_within_one_step():
    engine = proposer_engine("draft40", parallel=1)
    a = engine.scheduler.add(engine.new_seq(prompt_tokens(engine, 0), Request(max_tokens=100)))
    b = engine.scheduler.add(engine.new_seq(prompt_tokens(engine, 1), Request(max_tokens=5)))
    engine.scheduler.step()
    engine.scheduler.step()
    assert a.status == Status.RUNNING and b.status == Status.WAITING
    engine.scheduler.abort(a)
    assert a.status == Status.ABORTED and engine.scheduler.slots == [None]
    engine.scheduler.step()
    assert b.status in (Status.PREFILL, Status.RUNNING) and b.slot == 0
    while engine.scheduler.has_work:
        engine.scheduler.step()
    assert b.status == Status.FINISHED and b.completion_tokens == alone("draft40", prompt_tokens(engine, 1),
                                                                        Request(max_tokens=5))


def test_a_prefix_another_slot_holds_is_copied_not_evaluated():
    """The next turn of a conversation, arriving while its slot is taken: the slot it gets copies
    what the other holds of its prompt."""
    engine = proposer_engine("lookup", parallel=2)
    engine.policy = FixedLength(0)
    turn = engine.oracle_model.tokenize("the cat sat on the mat. " * 4)
    first = run_all(engine, [(turn, Request(max_tokens=6))])[0]
    assert first.slot == 0
    blocker = engine.scheduler.add(engine.new_seq(prompt_tokens(engine, 2), Request(max_tokens=50)))
    engine.scheduler.step()
    assert blocker.slot == 0  # the lowest free slot: the old conversation's cache is in slot 0
    follow = turn + first.completion_tokens + engine.oracle_model.tokenize(" and then", add_special=False)
    nxt = run_all(engine, [(follow, Request(max_tokens=4))])[0]
    assert nxt.slot == 1
    assert nxt.stats.prompt_tokens_evaluated <= len(follow) - len(turn)  # the shared part was copied
    assert nxt.completion_tokens == alone("lookup", follow, Request(max_tokens=4, speculative=False))


def test_requests_that_arrive_together_with_one_system_prompt_evaluate_it_once():
    """Three requests sharing a long prefix, added at once: the first fills it, the others wait for
    it and copy it, then fill their own tails; each gets what it gets alone."""
    engine = proposer_engine("lookup", parallel=3)
    engine.policy = FixedLength(0)
    system = engine.oracle_model.tokenize("the cat sat on the mat. " * 6)
    tails = ["a.b.c", "xyz zyx", "then the thin"]
    prompts = [system + engine.oracle_model.tokenize(t, add_special=False) for t in tails]
    seqs = run_all(engine, [(p, Request(max_tokens=5)) for p in prompts])
    assert seqs[0].stats.prompt_tokens_evaluated == len(prompts[0])
    for seq, prompt in zip(seqs[1:], prompts[1:]):
        assert seq.stats.prompt_tokens_evaluated <= len(prompt) - len(system) + 1
    evaluated = sum(n for p in engine.oracle.passes for _, n in p)
    assert evaluated < sum(len(p) for p in prompts) - len(system)  # the shared part once, not three times
    for seq, prompt in zip(seqs, prompts):
        assert seq.completion_tokens == alone("lookup", prompt, Request(max_tokens=5, speculative=False))


def test_a_failed_pass_fails_its_sequences_and_the_scheduler_goes_on():
    engine = proposer_engine("lookup", parallel=2)
    a, b = (engine.scheduler.add(engine.new_seq(prompt_tokens(engine, i), Request(max_tokens=10))) for i in (0, 1))
    real = engine.oracle.decode_rows
    engine.oracle.decode_rows = lambda rows: (_ for _ in ()).throw(RuntimeError("boom"))
    engine.scheduler.step()
    assert a.status == b.status == Status.ABORTED and isinstance(a.error, RuntimeError)
    engine.oracle.decode_rows = real
    c = run_all(engine, [(prompt_tokens(engine, 2), Request(max_tokens=3))])[0]
    assert c.status == Status.FINISHED and len(c.completion_tokens) == 3
    assert np.all([s is None for s in engine.scheduler.slots])


def test_with_nobody_waiting_a_step_drafts_for_every_sequence_or_for_none():
    """With nobody waiting, a draft for one sequence of the batch alone would leave the batch as
    many passes and dearer ones: each shared step drafts for both or for neither. With a request
    waiting, one sequence's draft runs alone (it finishes sooner, and lets the next one in)."""
    def shared_steps(n_requests):
        engine = proposer_engine("lookup", parallel=2)
        seqs = run_all(engine, [(prompt_tokens(engine, i), Request(max_tokens=30)) for i in (0, 3, 4)][:n_requests])
        first, second = ([r for r in s.stats.records if r.batch_seqs == 2] for s in seqs[:2])
        return [(a.drafted > 0, b.drafted > 0) for a, b in zip(first[1:], second[1:])]  # after the first tokens

    closed = shared_steps(2)
    assert all(a == b for a, b in closed) and any(a for a, _ in closed)
    queued = shared_steps(3)
    assert any(a != b for a, b in queued)
