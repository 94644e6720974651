"""Drafting on real models: prompt lookup, adaptive length, and a draft with another tokenizer."""

from __future__ import annotations

import pytest

from localspec.compat import IncompatibleModels
from localspec.engine import Engine
from localspec.policy import AdaptiveLength
from localspec.proposers import CrossTokenizerProposer, PromptLookupProposer

pytestmark = pytest.mark.model

PASSAGE = ("The museum opens at nine in the morning and closes at six in the evening. Tickets cost twelve "
           "euros for adults and six euros for children. Guided tours start every hour from the main hall.")


def grounded():
    return [{"role": "user", "content": f"Repeat this notice exactly:\n\n{PASSAGE}"}]


def test_prompt_lookup_on_a_grounded_prompt(pair_paths):
    with Engine(pair_paths[0], "ngram", n_ctx=1024) as engine:
        assert isinstance(engine.proposer, PromptLookupProposer)
        spec = engine.generate(grounded(), max_tokens=60)
        base = engine.generate(grounded(), max_tokens=60, speculative=False)
    assert spec.stats.accepted >= 10  # the copied stretches are drafted from the prompt, for free
    assert spec.stats.steps < len(spec.tokens) - 8
    assert spec.text == base.text


def test_adaptive_is_the_default_and_calibrates(pair_paths):
    with Engine(*pair_paths, n_ctx=512) as engine:
        assert isinstance(engine.policy, AdaptiveLength)
        r = engine.generate([{"role": "user", "content": "Name three fruits."}], max_tokens=24)
        assert engine.policy.calibrated
        assert engine.policy.verify_cost(1) > 0 and engine.policy.draft_cost(4) > 0
        assert set(engine.policy.verify_cost.mean) >= {1, 2, 4, 8, 16}
        assert r.stats.steps >= 1


def test_a_draft_that_does_not_pay_costs_nothing(pair_paths):
    """When the measured costs say drafting cannot win, the draft model is not run at all: no
    prompt evaluation on it (TTFT is the oracle's alone) and no drafting, probes aside."""
    with Engine(*pair_paths, n_ctx=512) as engine:
        policy = AdaptiveLength(probe_every=10_000, min_trials=0)
        policy.calibrate(lambda n: 0.05 * n, lambda n: 1.0 * n)  # a draft token dearer than 20 oracle passes
        engine.policy = policy
        assert policy.idle
        messages = [{"role": "user", "content": "Name three fruits."}]
        r = engine.generate(messages, max_tokens=16)
        base = engine.generate(messages, max_tokens=16, speculative=False)
        assert engine.proposer.tokens_evaluated == 0
        assert r.stats.drafted == 0 and r.tokens == base.tokens


def test_a_request_without_drafting_leaves_the_draft_and_the_policy_alone(pair_paths):
    """speculative=False is the oracle alone on the same engine (the bench's paired baseline): the
    draft model evaluates nothing and the length policy learns nothing from it."""
    with Engine(*pair_paths, n_ctx=512) as engine:
        r = engine.generate([{"role": "user", "content": "Name three fruits."}], max_tokens=12, speculative=False)
        policy = engine.policy
        assert r.stats.drafted == 0 and r.stats.steps == len(r.tokens)
        assert engine.proposer.tokens_evaluated == 0
        assert not policy.calibrated and policy.trials == 0 and policy.time_spent == 0.0


def test_after_a_pause_the_draft_keeps_the_start_it_holds_and_catches_up_on_recent_text_only(pair_paths):
    import numpy as np

    from localspec.sampling import SamplingParams

    with Engine(*pair_paths, n_ctx=512, draft_length=4) as engine:
        drafter, rng, greedy = engine.proposer, np.random.default_rng(0), SamplingParams()
        long = engine.oracle_model.tokenize(PASSAGE * 2, add_special=True, parse_special=False)
        drafter.prefill(long[:10])
        before = drafter.tokens_evaluated
        draft = drafter.propose(long, 4, greedy, rng)  # 70+ tokens to catch up: only the latest 16
        assert (drafter.keep, drafter.start) == (10, len(long) - 16)
        assert drafter.ctx.tokens[:26] == long[:10] + long[-16:]  # the prompt's start, a gap, the recent text
        assert drafter.tokens_evaluated - before == 16 + len(draft) - 1
        more = long + [int(draft.tokens[0]), long[20]]  # the first draft token accepted, then a recovered one
        drafter.propose(more, 4, greedy, rng)  # drafting goes on after the gap: no new window
        assert (drafter.keep, drafter.start) == (10, len(long) - 16)
        assert drafter.ctx.tokens[:28] == long[:10] + more[-18:]

        short = engine.oracle_model.tokenize("Name three fruits.", add_special=True, parse_special=False)
        drafter.prefill(short[:-1], evaluate=False)  # a new prompt: the gap is forgotten
        assert drafter.keep == drafter.start == 0
        assert len(drafter.propose(short, 4, greedy, rng)) >= 1
        assert drafter.ctx.tokens[:len(short)] == short


def test_incompatible_pair_refused_without_cross_tokenizer(registry, pair_paths):
    with pytest.raises(IncompatibleModels, match="cannot draft for oracle"):
        Engine(registry.resolve("gemma-3-270m-q4_k_m"), pair_paths[1], n_ctx=512)


def test_cross_tokenizer_draft_keeps_greedy_output_the_oracles(registry, pair_paths, monkeypatch):
    gemma = registry.resolve("gemma-3-270m-q4_k_m")
    prompts = ["The capital of France is Paris. The capital of Germany is",
               "Once upon a time, there was a little girl who",
               "def fibonacci(n):\n"]
    with Engine(gemma, pair_paths[1], n_ctx=1024, cross_tokenizer=True, draft_length=4) as cross:
        assert isinstance(cross.proposer, CrossTokenizerProposer)
        steps = []
        original = cross._accept

        def recording(draft, logits, *args):
            out, n = original(draft, logits, *args)
            steps.append((logits.argmax(axis=1).copy(), out.copy()))
            return out, n

        monkeypatch.setattr(cross, "_accept", recording)
        same = 0
        accepted = 0
        for p in prompts:
            spec = cross.generate(p, max_tokens=32)
            base = cross.generate(p, max_tokens=32, speculative=False)
            same += spec.text == base.text
            accepted += spec.stats.accepted
        for argmax, out in steps:
            assert out.tolist() == argmax[:len(out)].tolist()
    assert accepted > 0  # the re-tokenized drafts do get accepted
    assert same >= len(prompts) - 1
