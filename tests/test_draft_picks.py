"""A draft model that picks from the top k of its rows as the device keeps them (`TopRow`,
`LlamaContext.sample_top`): what a GPU gets, so that a drafted token does not cost the host a read
of the vocabulary's logits. The maths on scripted rows; the engine on the default pair, with the
device's part played by the CPU backend (the same llama.cpp chain)."""

from __future__ import annotations

import numpy as np
import pytest

from localspec.batch import TopRow
from localspec.runtime.calibrate import draft_picks_faster, measure
from localspec.runtime.engine import Engine
from localspec.runtime.factory import default_policy
from localspec.speculative.proposers import DEVICE_TOP_K, DraftModelProposer, draft_picks_suffice
from localspec.speculative.proposal import top_row_proposal
from localspec.speculative.sampling import SamplingParams, logits_to_probs, top_probability, top_row_greedy
from scripted import ScriptedContext, ScriptedModel, hashed_logits, related_logits

K = 8


class TopContext(ScriptedContext):
    """A scripted draft context whose rows come back as a device's top k leaves them: k ids and
    their logits, in no order."""

    def decode_rows(self, rows):
        whole = np.asarray(super().decode_rows(rows))  # [n, vocab]
        rng = np.random.default_rng(len(self.passes))
        out = []
        for row in whole:
            ids = rng.permutation(np.argpartition(row, -K)[-K:]).astype(np.int32)  # [K], shuffled
            out.append(TopRow(ids, row[ids].astype(np.float32)))
        return out


def test_a_greedy_pick_from_the_top_k_is_the_rows_argmax_and_its_floor_is_taken_over_the_k():
    row = np.array([0.0, 3.0, 1.0, 3.0, -2.0, 2.5], dtype=np.float32)
    ids = np.array([5, 3, 1, 2], dtype=np.int32)  # the top 4, shuffled: 3 and 1 tie at the top
    token, sure = top_row_greedy(ids, row[ids], 0.3)
    over_k = 1.0 / np.exp(row[ids] - 3.0).sum()
    assert token == 1 == int(np.argmax(row)) and sure == (over_k >= 0.3)
    assert over_k >= top_probability(row, 1)  # the floor over k is the laxer one
    assert 0.36 < over_k < 0.37  # e^0 / (2 e^0 + e^-0.5 + e^-2)
    assert top_row_greedy(ids, row[ids], 0.36)[1] and not top_row_greedy(ids, row[ids], 0.37)[1]
    assert top_row_greedy(ids, row[ids], 0.0) == (1, True)


def test_a_sampled_pick_from_the_top_k_is_drawn_from_the_distribution_acceptance_is_handed():
    """`top_row_proposal`: the request's distribution over the k (temperature, top-k, top-p), its
    support in ascending ids; draws from it follow it."""
    rng = np.random.default_rng(3)
    row = rng.normal(size=50).astype(np.float32) * 2
    ids = rng.permutation(np.argpartition(row, -K)[-K:]).astype(np.int32)
    for sampling in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=3, top_p=0.9)):
        support, probs = top_row_proposal(ids, row[ids], sampling)
        assert (np.diff(support) > 0).all() and set(support.tolist()) == set(ids.tolist())
        np.testing.assert_allclose(probs, logits_to_probs(row[support], sampling))
        assert probs.sum() == pytest.approx(1.0)


@pytest.mark.parametrize("n_draft", [36, 40, 44])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0),
                                      SamplingParams(temperature=0.8, top_k=5)], ids=["greedy", "sampled", "top-k"])
def test_a_draft_model_picks_from_its_rows_top_k_over_the_oracles_vocabulary(n_draft, sampling):
    """As a draft that reads whole rows does (test_proposers), but from each row's top k: greedy,
    the whole row's argmax; sampled, each token drawn from the request's distribution over the k
    (ids the oracle lacks left out), which is what the draft hands acceptance."""
    n_oracle = 40
    model = ScriptedModel.sized(n_draft)
    logits = related_logits(hashed_logits(1, n_oracle), n_oracle, 2, n_draft, extra_bias=3.0)
    ctx = TopContext(model, logits)
    proposer = DraftModelProposer(ctx, n_vocab=n_oracle)
    history = model.tokenize("the")
    for seed in range(20):
        ctx.reset()
        draft = proposer.propose(history, 4, sampling, np.random.default_rng(seed))
        tokens = draft.tokens.tolist()
        k = len(tokens)
        assert (k == 4 or tokens[-1] == model.eos) and max(tokens) < n_oracle
        rows = [logits(tuple(history + tokens[:i])) for i in range(k)]  # [k] x [n_draft]
        tops = [np.sort(np.argpartition(r, -K)[-K:]) for r in rows]  # each row's top K ids, ascending
        tops = [top[top < n_oracle] for top in tops]
        if sampling.greedy:
            assert draft.probs is None
            assert tokens == [int(np.argmax(r[:n_oracle])) for r in rows]  # the top K holds the argmax
        else:
            expected = np.zeros((k, n_oracle))
            for i, (row, top) in enumerate(zip(rows, tops)):
                expected[i, top] = logits_to_probs(row[top], sampling)
                assert expected[i, tokens[i]] > 0
            np.testing.assert_allclose(np.asarray(draft.probs), expected, rtol=1e-6, atol=1e-12)


def test_a_request_that_needs_whole_draft_rows_gets_them():
    """A logit bias, a grammar or a seed (whose noise covers the vocabulary) need the whole row."""
    assert draft_picks_suffice(SamplingParams(), False) and draft_picks_suffice(SamplingParams(temperature=0.7), False)
    assert not draft_picks_suffice(SamplingParams(logit_bias=((3, 1.0),)), False)
    assert not draft_picks_suffice(SamplingParams(), True)
    assert not draft_picks_suffice(SamplingParams(temperature=0.7, seed=1), False)
    model = ScriptedModel.sized(40)
    proposer = DraftModelProposer(TopContext(model, hashed_logits(1, 40)))
    with pytest.raises(RuntimeError):
        proposer.propose(model.tokenize("the"), 4, SamplingParams(temperature=0.7, seed=1), np.random.default_rng(0))


class Recorder:
    """Every verify of a step: the oracle's argmax at each verified position, and what it emitted."""

    def __init__(self, engine: Engine, monkeypatch) -> None:
        self.steps: list[tuple[list[int], list[int]]] = []
        original = engine.stepper.accept

        def recording(tokens, probs, logits, sampling, rng, *, picked=None, **kw):
            out, n_accepted = original(tokens, probs, logits, sampling, rng, picked=picked, **kw)
            argmax = logits.argmax(axis=1) if picked is None else picked
            self.steps.append((argmax.tolist(), out.tolist()))
            return out, n_accepted

        monkeypatch.setattr(engine.stepper, "accept", recording)

    def assert_the_oracles(self) -> None:
        assert self.steps
        for argmax, out in self.steps:
            assert out == argmax[:len(out)]


def test_the_engine_drafts_from_the_devices_top_rows_only_where_they_are_all_it_needs(engine, monkeypatch):
    """Plain greedy and plain sampled requests draft from their rows' top k; a logit bias, a grammar
    and a seed read whole rows. Greedy, every emitted token is the oracle's argmax where it was
    verified, and the draft is accepted as often as from whole rows."""
    prompt = [{"role": "user", "content": "Explain how a refrigerator keeps food cold, step by step."}]
    host = engine.generate(prompt, max_tokens=48)
    engine.slots.draft_top = DEVICE_TOP_K
    try:
        seqs = {}
        for name, options in {"plain": {}, "sampled": {"temperature": 0.7}, "bias": {"logit_bias": ((13, -1.0),)},
                              "json": {"schema": {"type": "object"}}, "seeded": {"temperature": 0.7, "seed": 1}}.items():
            rec = Recorder(engine, monkeypatch)
            seqs[name] = engine.prepare(prompt, max_tokens=48 if name == "plain" else 8, **options)
            for _ in engine.scheduler.run(seqs[name]):
                pass
            if name == "plain":
                rec.assert_the_oracles()
            monkeypatch.undo()
        assert {name: seq.draft_picks for name, seq in seqs.items()} == {
            "plain": True, "sampled": True, "bias": False, "json": False, "seeded": False}
        plain = seqs["plain"].stats
        assert plain.drafted > 20 and plain.accepted >= 0.8 * host.stats.accepted
    finally:
        engine.slots.draft_top = 0
    assert not engine.draft_ctx.sample_top(0) and engine.generate(prompt, max_tokens=48).tokens == host.tokens


def test_sequences_drafting_together_pick_from_their_top_rows_and_calibration_leaves_none(pair_paths, monkeypatch):
    """Two requests at once: one decode a draft round holds both sequences' rows, each a TopRow;
    greedy, every emitted token is the oracle's. Timing the draft's proposals both ways, and
    calibrating with its rows so kept, as a GPU's engine does at load, leave no sequence picked
    for and every sequence empty."""
    with Engine(*pair_paths, n_ctx=512, n_threads=2, parallel=2, cost_cache=False, draft_length=6) as engine:
        engine.slots.draft_top = DEVICE_TOP_K
        rec = Recorder(engine, monkeypatch)
        seqs = [engine.prepare([{"role": "user", "content": text}], max_tokens=40)
                for text in ("Name the planets of the solar system.", "Write a haiku about the sea.")]
        for seq in seqs:
            engine.scheduler.add(seq)
        while engine.scheduler.has_work:
            engine.scheduler.step()
        rec.assert_the_oracles()
        assert all(seq.draft_picks and seq.stats.drafted > 0 for seq in seqs)
        monkeypatch.undo()
        for seq in range(2):
            engine.draft_ctx.sample_top(seq)
        faster, seconds = draft_picks_faster(engine.draft_ctx, DEVICE_TOP_K)  # what a GPU's engine asks at load
        assert isinstance(faster, bool) and set(seconds) == {"whole", "top"} and all(t > 0 for t in seconds.values())
        assert not engine.draft_ctx._picks and not engine.draft_ctx.seq_tokens(0)
        fresh = default_policy(engine.proposer)  # the adaptive policy, which learns costs
        measure(fresh, engine.oracle, engine.draft_ctx, draft_top=DEVICE_TOP_K)
        assert fresh.needs_costs() == (False, False)
        assert not engine.draft_ctx._picks
        assert all(not ctx.seq_tokens(s) for ctx in engine.contexts for s in range(2))


def test_an_engine_whose_draft_runs_on_a_gpu_times_both_ways_at_load_and_keeps_the_faster(pair_paths, monkeypatch,
                                                                                            caplog):
    """What `Engine` does where the draft runs every layer on a local GPU (here pretended: the CPU
    backend runs the same chains): it times a draft proposal with whole rows and with their top k
    kept in the graph, draws from the faster, says so in its log, and generates the oracle's text."""
    import logging

    from localspec.runtime import engine as engine_module

    monkeypatch.setattr(engine_module, "_offloaded", lambda layers, model: model is not None)
    caplog.set_level(logging.INFO, logger="localspec.runtime.engine")
    with Engine(*pair_paths, n_ctx=512, n_threads=2, cost_cache=False, calibrate=True) as engine:
        seconds = engine.draft_picks_seconds
        assert set(seconds) == {"whole", "top"}
        assert engine.slots.draft_top == (DEVICE_TOP_K if seconds["top"] < seconds["whole"] else 0)
        assert "the draft picks from" in caplog.text
        messages = [{"role": "user", "content": "Name three fruits."}]
        assert engine.generate(messages, max_tokens=24).text == engine.generate(messages, max_tokens=24,
                                                                                speculative=False).text
