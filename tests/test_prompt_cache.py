"""The prompt cache (localspec.runtime.prompt_cache, Slots.admit): finished sequences' oracle
caches kept in host memory when a new request takes their slot, loaded back for a later prompt that
starts the same way; least recently used out first, within a byte budget; one pool never reuses
another's. Exact cases over scripted contexts, and llama.cpp's sequence state on the real oracle."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from localspec.llama.context import SeqState, shared_prefix
from localspec.runtime.engine import Request
from localspec.runtime.prompt_cache import PromptCache
from localspec.speculative.policy import FixedLength
from localspec.speculative.sampling import greedy_argmax
from test_engine_scripted import proposer_engine
from test_scheduler import alone, run_all


def state(*tokens: int, size: int = 100) -> SeqState:
    return SeqState(tuple(tokens), (ctypes.c_uint8 * size)(), size)


# -- the store


def test_the_longest_shared_prefix_of_the_pool_is_found():
    cache = PromptCache(10_000)
    cache.put(state(1, 2, 3, 4))
    cache.put(state(1, 2, 9, 9, 9))
    cache.put(state(1, 2, 3, 4, 5, 6), pool="other")
    found, n = cache.match([1, 2, 3, 4, 5, 6, 7])
    assert found.tokens == (1, 2, 3, 4) and n == 4
    found, n = cache.match([1, 2, 3, 4, 5, 6, 7], pool="other")
    assert found.tokens == (1, 2, 3, 4, 5, 6) and n == 6
    assert cache.match([7, 7]) == (None, 0)
    assert cache.match([1, 2, 3], pool="nobody") == (None, 0)


def test_the_least_recently_used_go_first_within_the_budget():
    one = state(1, 1, size=400).nbytes
    cache = PromptCache(3 * one)
    for t in (1, 2, 3):
        assert cache.put(state(t, t, size=400))
    found, n = cache.match([1, 1, 5])
    cache.used(found, "", n)  # (1, 1) is now the most recent: (2, 2) is the oldest
    cache.put(state(4, 4, size=400))
    assert len(cache) == 3 and cache.nbytes == 3 * one
    assert cache.match([2, 2])[0] is None
    assert all(cache.match([t, t])[1] == 2 for t in (1, 3, 4))
    assert (cache.hits, cache.tokens_reused) == (1, 2)


def test_a_state_that_extends_a_kept_one_replaces_it_and_one_held_already_is_not_kept_twice():
    cache = PromptCache(10_000)
    cache.put(state(1, 2, 3))
    assert cache.put(state(1, 2, 3, 4, 5))
    assert len(cache) == 1 and cache.match([1, 2, 3, 4, 5])[1] == 5
    assert not cache.put(state(1, 2, 3, 4))  # the kept (1..5) serves every prompt this one would
    assert len(cache) == 1
    assert cache.put(state(1, 2, 3, 4), pool="other")  # another pool's is its own
    assert len(cache) == 2


def test_a_state_larger_than_the_budget_is_not_kept():
    cache = PromptCache(50)
    assert not cache.put(state(1, 2, size=100))
    assert len(cache) == 0 and cache.nbytes == 0
    with pytest.raises(ValueError):
        PromptCache(0)


# -- the engine over scripted contexts


def cached_engine(parallel: int = 1, capacity: int = 1 << 20):
    engine = proposer_engine("lookup", parallel=parallel)
    engine.policy = FixedLength(0)
    engine.slots.prompt_cache = PromptCache(capacity)
    return engine


def test_a_prompt_sent_again_after_its_slot_was_taken_is_loaded_back_not_evaluated():
    engine = cached_engine()
    first = engine.oracle_model.tokenize("the cat sat on the mat. " * 4)
    other = engine.oracle_model.tokenize("a dog ran in the park; " * 4)
    a = run_all(engine, [(first, Request(max_tokens=6))])[0]
    assert a.stats.prompt_tokens_evaluated == len(first)
    run_all(engine, [(other, Request(max_tokens=6))])  # takes the one slot: the first's cache is kept aside
    assert len(engine.slots.prompt_cache) == 1
    again = run_all(engine, [(first, Request(max_tokens=6))])[0]
    assert again.stats.prompt_tokens_evaluated == 1  # only the last prompt token, which step one evaluates
    assert again.completion_tokens == a.completion_tokens == alone("lookup", first, Request(max_tokens=6,
                                                                                            speculative=False))
    # what the slot did not hold already (the other prompt shares its first token, BOS)
    assert engine.slots.prompt_cache.hits == 1
    assert engine.slots.prompt_cache.tokens_reused == len(first) - 1 - shared_prefix(first, other)
    # the next turn of that conversation reuses the answer's cells too
    follow = first + a.completion_tokens + engine.oracle_model.tokenize(" and then", add_special=False)
    run_all(engine, [(other, Request(max_tokens=6))])
    nxt = run_all(engine, [(follow, Request(max_tokens=4))])[0]
    assert nxt.stats.prompt_tokens_evaluated <= len(follow) - len(first)


def test_without_a_prompt_cache_the_slot_s_old_text_is_evaluated_again():
    engine = cached_engine()
    engine.slots.prompt_cache = None
    first = engine.oracle_model.tokenize("the cat sat on the mat. " * 4)
    run_all(engine, [(first, Request(max_tokens=6))])
    other = engine.oracle_model.tokenize("a dog ran in the park; " * 4)
    run_all(engine, [(other, Request(max_tokens=6))])
    again = run_all(engine, [(first, Request(max_tokens=6))])[0]
    assert again.stats.prompt_tokens_evaluated == len(first) - shared_prefix(first, other)


def test_one_pool_never_reuses_another_s_cache_in_a_slot_or_the_prompt_cache():
    engine = cached_engine(parallel=2)
    first = engine.oracle_model.tokenize("the cat sat on the mat. " * 4)
    seqs = [engine.scheduler.add(engine.new_seq(first, Request(max_tokens=6), pool="alice"))]
    while engine.scheduler.has_work:
        engine.scheduler.step()
    for pool, expected in (("bob", len(first)), ("alice", 1)):  # bob's copy of the same prompt: evaluated
        seq = engine.scheduler.add(engine.new_seq(first, Request(max_tokens=6), pool=pool))
        while engine.scheduler.has_work:
            engine.scheduler.step()
        assert seq.stats.prompt_tokens_evaluated == expected, pool
        seqs.append(seq)
    assert seqs[1].completion_tokens == seqs[0].completion_tokens == seqs[2].completion_tokens


def test_prompt_logprobs_evaluate_every_prompt_token_and_keep_the_slot_s_text_aside():
    engine = cached_engine()
    first = engine.oracle_model.tokenize("the cat sat on the mat. " * 4)
    run_all(engine, [(first, Request(max_tokens=6))])
    other = engine.oracle_model.tokenize("a dog ran in the park; " * 4)
    b = run_all(engine, [(other, Request(max_tokens=3, prompt_logprobs=0))])[0]
    assert b.stats.prompt_tokens_evaluated == len(other) and len(engine.slots.prompt_cache) == 1
    assert run_all(engine, [(first, Request(max_tokens=6))])[0].stats.prompt_tokens_evaluated == 1


# -- llama.cpp's sequence state, on the real oracle


@pytest.mark.model
def test_a_saved_sequence_loads_back_into_another_sequence_and_continues_as_it_would(pair_paths):
    from localspec.llama.context import LlamaContext, LlamaModel

    model = LlamaModel(pair_paths[0])
    try:
        with LlamaContext(model, n_ctx=256, n_seq=2, n_threads=2) as ctx:
            prompt = model.tokenize("The capital of France is Paris. The capital of Italy is")
            ctx.decode(prompt[:-1], seq=0)
            saved = ctx.save_seq(0)
            assert saved is not None and saved.tokens == tuple(prompt[:-1]) and saved.nbytes > saved.size
            assert saved.size >= model.kv_bytes_per_token() * (len(prompt) - 1) // 2
            expected = np.array(ctx.decode(prompt[-1:], seq=0))
            ctx.decode(model.tokenize("Something else entirely, to fill it."), seq=1)
            assert ctx.load_seq(saved, seq=1)
            assert ctx.seq_tokens(1) == prompt[:-1]
            got = np.array(ctx.decode(prompt[-1:], seq=1))
            assert greedy_argmax(got) == greedy_argmax(expected)
            np.testing.assert_allclose(got, expected, atol=0.05)
            assert ctx.save_seq(0) is not None and LlamaContext.save_seq(ctx, 1).tokens == tuple(prompt)
    finally:
        model.close()


def test_records_twice_on_two_slots_give_what_each_gets_alone():
    """The bench's records, small: prompts with one long system prompt, more than the slots, all at
    once and then all again (the second time from the prompt cache and the slots): every answer is
    the one its prompt gets alone, and the second pass evaluates far fewer prompt tokens."""
    engine = cached_engine(parallel=2)
    system = engine.oracle_model.tokenize("the cat sat on the mat. " * 5)
    prompts = [system + engine.oracle_model.tokenize(t * 4, add_special=False)  # tails of 20+ tokens: worth a copy
               for t in ("a.b.c.d", "xyz zyx xyz", "then the thin", "hello, hello", "dfg,bcat.")]
    expected = [alone("lookup", p, Request(max_tokens=6, speculative=False)) for p in prompts]
    evaluated = []
    for _ in range(2):
        seqs = run_all(engine, [(p, Request(max_tokens=6)) for p in prompts])
        assert [s.completion_tokens for s in seqs] == expected
        evaluated.append(sum(s.stats.prompt_tokens_evaluated for s in seqs))
    assert evaluated[0] < sum(map(len, prompts)) - len(system)  # the system prompt was shared in pass 1
    assert evaluated[1] <= len(prompts) * 2  # pass 2: next to nothing


def test_a_shared_prefix_taken_later_leaves_the_slot_holding_the_prompt_s_prefix_only():
    """`share` after a wait: a kept state that goes on past the prompt is cut back to what they share."""
    engine = cached_engine()
    prompt = engine.oracle_model.tokenize("the cat sat on the mat. " * 4)
    first = run_all(engine, [(prompt, Request(max_tokens=6))])[0]
    engine.slots.prompt_cache.put(engine.oracle.save_seq(0))  # the prompt and its answer
    engine.oracle.rollback(3, seq=0)
    seq = engine.new_seq(prompt[:-5], Request(max_tokens=2))
    seq.slot = 0
    engine.slots.share(seq)
    assert engine.oracle.seq_tokens(0) == prompt[:-6] and first.completion_tokens


@pytest.mark.model
def test_a_copy_is_done_at_once_so_a_state_loaded_next_changes_neither_sequence(pair_paths):
    """copy_seq, then load_seq into the copy's source, before any decode: each sequence holds its
    own text (llama.cpp's seq_cp across streams waits for the next decode, and then copied the
    loaded cells over the copy)."""
    from localspec.llama.context import LlamaContext, LlamaModel

    model = LlamaModel(pair_paths[0])
    try:
        with LlamaContext(model, n_ctx=256, n_seq=2, n_threads=2) as ctx:
            a = model.tokenize("The capital of France is Paris. The capital of Italy is")
            b = model.tokenize("Once upon a time there was a little dog who lived by the")
            expected = {}
            for name, prompt in (("a", a), ("b", b)):
                expected[name] = np.array(ctx.decode(prompt, seq=0))
                ctx.rollback(0, seq=0)
            ctx.decode(b[:-1], seq=0)
            kept_b = ctx.save_seq(0)
            ctx.rollback(0, seq=0)
            ctx.decode(a[:-1], seq=0)
            assert ctx.copy_seq(0, 1, len(a) - 1) and ctx.seq_tokens(1) == a[:-1]
            assert ctx.load_seq(kept_b, seq=0)
            got_a = np.array(ctx.decode(a[-1:], seq=1))
            got_b = np.array(ctx.decode(b[-1:], seq=0))
            # a pass of one token against one of the whole prompt: llama.cpp's sums differ by ~0.01
            # (another text's cells differ by ~25)
            np.testing.assert_allclose(got_a, expected["a"], atol=0.05)
            np.testing.assert_allclose(got_b, expected["b"], atol=0.05)
    finally:
        model.close()
