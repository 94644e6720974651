"""Drafting on real models: prompt lookup, adaptive length, and a draft with another tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

from localspec.speculative.compat import IncompatibleModels
from localspec.runtime.engine import Engine
from localspec.speculative.policy import AdaptiveLength, HybridLength
from localspec.llama.context import LlamaContext, LlamaModel
from localspec.speculative.cross_tokenizer import CrossTokenizerProposer
from localspec.speculative.lookup import PromptLookupProposer
from localspec.speculative.proposers import DraftModelProposer
from localspec.speculative.sampling import SamplingParams

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


def test_the_default_drafts_from_the_text_and_from_the_model_and_keeps_the_oracles_text(pair_paths, monkeypatch):
    """By default prompt lookup works beside the draft model: a notice to repeat is drafted from the
    prompt, a haiku by the model; every emitted token is the oracle's argmax where it was verified."""
    from test_engine import VerifyRecorder

    with Engine(*pair_paths, n_ctx=1024, cost_cache=False) as engine:
        rec = VerifyRecorder(engine, monkeypatch)
        sources = set()
        for messages in (grounded(), [{"role": "user", "content": "Write a haiku about the sea."}]):
            rec.steps.clear()
            r = engine.generate(messages, max_tokens=60)
            sources |= {x.source for x in r.stats.records if x.drafted}
            for argmax, out, n_accepted in rec.steps:
                assert out.tolist() == argmax[:n_accepted + 1].tolist()
            assert r.tokens == np.concatenate([out for _, out, _ in rec.steps])[:len(r.tokens)].tolist()
        assert sources == {"lookup", "model"}
        assert r.stats.accepted > 0


def test_adaptive_is_the_default_and_learns_its_costs_from_the_steps_alone(pair_paths, tmp_path, monkeypatch):
    """A fresh engine times nothing on purpose: the oracle decodes the prompt once, which gives the
    first token (the first step: it drafts nothing), and then once per step; the draft takes the
    oracle's cache of the prompt in its first proposal. The default drafts
    with the model and prompt lookup, each with its adaptive policy. The fitted costs are kept for
    the next engine of the same setting, and ignored by one whose setting differs."""
    monkeypatch.setenv("LOCALSPEC_COST_CACHE", str(tmp_path))
    messages = [{"role": "user", "content": "Name three fruits."}]
    with Engine(*pair_paths, n_ctx=512, n_threads=2) as engine:
        assert isinstance(engine.policy, HybridLength) and engine.proposer.describe() == "hybrid"
        assert isinstance(engine.policy.model, AdaptiveLength) and isinstance(engine.policy.lookup, AdaptiveLength)
        assert engine.policy.lookup.verify_cost is engine.policy.model.verify_cost  # one oracle
        assert not engine.policy.model.verify_cost.ready  # nothing measured yet, nothing timed at start-up
        decodes = []
        original = engine.oracle.decode_rows
        monkeypatch.setattr(engine.oracle, "decode_rows", lambda rows: decodes.append(len(rows[0].tokens)) or
                            original(rows))
        r = engine.generate(messages, max_tokens=24)
        s = r.stats
        assert len(decodes) == s.steps  # the prompt's pass (the first token), then one verify pass per step
        assert s.records[0].drafted == 0 and s.records[0].k == 0
        first_model = next(x for x in s.records if x.source == "model")
        assert first_model.draft_evaluated <= 2  # the draft took the oracle's cache of the prompt
        assert engine.draft_ctx.seq_tokens()[:s.prompt_tokens] == engine.oracle.seq_tokens()[:s.prompt_tokens]
        assert sum(x.drafted for x in s.records) == s.drafted and sum(x.accepted for x in s.records) == s.accepted
        assert sum(x.draft_time for x in s.records) == pytest.approx(s.draft_time)
        assert sum(x.verify_time for x in s.records) == pytest.approx(s.verify_time)
        assert [x.context for x in s.records] == sorted(x.context for x in s.records)
        assert s.records[0].context == s.prompt_tokens - 1
        policy = engine.policy.model
        assert policy.verify_cost.ready and policy.draft_cost.ready and policy.est.trials > 0
        learned = policy.verify_cost(9, 100), policy.draft_cost(4, 100), policy.est.acceptance
    kinds = {p.name.split("-")[0] for p in tmp_path.iterdir()}
    assert {"acceptance", "draft", "draft_round", "verify"} <= kinds <= {"acceptance", "draft", "draft_round", "verify",
                                                                  "lookup_acceptance"}
    with Engine(*pair_paths, n_ctx=512, n_threads=2) as again:
        model = again.policy.model
        assert (model.verify_cost(9, 100), model.draft_cost(4, 100), model.est.acceptance) == pytest.approx(learned)
        assert model.est.fresh_trials == min(model.est.trials, model.min_trials)
    with Engine(*pair_paths, n_ctx=512, n_threads=2, lookup=False) as alone:  # the draft model alone: the same
        assert isinstance(alone.policy, AdaptiveLength)
        assert (alone.policy.verify_cost(9, 100), alone.policy.draft_cost(4, 100),
                alone.policy.est.acceptance) == pytest.approx(learned)
    with Engine(*pair_paths, n_ctx=1024, n_threads=2) as sized:  # another context size (`generate` fits
        model = sized.policy.model  # one to each prompt): the same costs
        assert (model.verify_cost(9, 100), model.draft_cost(4, 100)) == pytest.approx(learned[:2])
    with Engine(*pair_paths, n_ctx=512, n_threads=1) as other:  # another thread count: other costs
        model = other.policy.model
        assert not model.verify_cost.ready and not model.draft_cost.ready
        assert model.est.acceptance == pytest.approx(learned[2])  # acceptance does not depend on threads


def test_a_fresh_process_never_drafts_with_a_draft_as_dear_as_its_oracle(pair_paths):
    """A draft that costs what its oracle costs (here the oracle itself) cannot pay whatever its
    acceptance: a fresh engine never drafts with it (it drafted 52 tokens of 128 at 0.94x before,
    learning that), and says why; prompt lookup, free to make, may still draft."""
    oracle = pair_paths[0]
    with Engine(oracle, oracle, n_ctx=512, n_threads=2, cost_cache=False) as engine:
        messages = [{"role": "user", "content": "Explain how a refrigerator works, step by step."}]
        r = engine.generate(messages, max_tokens=96)
        assert not [x for x in r.stats.records if x.source == "model"]
        assert r.stats.idle_steps > 80 and "a draft token" in r.stats.idle_reason
        assert r.text == engine.generate(messages, max_tokens=96, speculative=False).text


def test_calibrating_at_load_times_both_models_and_leaves_the_contexts_empty(pair_paths, monkeypatch):
    """What the engine does at load on a GPU (`calibrate=None` there), asked for on the CPU: the
    policy knows the oracle's passes (one token and several), the draft's proposals and, with
    several slots, the batched passes and draft rounds before the first request; every sequence is
    empty after, and the first request's text is the oracle's. Those decodes ran on a thread that
    has ended (`calibrate.on_a_passing_thread`: no OpenMP pool of theirs is left beside the pool of
    the thread that generates)."""
    import threading

    from localspec.llama import context as llama_context

    decoded_on = []
    real = llama_context.llama_cpp.llama_decode
    monkeypatch.setattr(llama_context.llama_cpp, "llama_decode",
                        lambda ctx, batch: decoded_on.append(threading.current_thread()) or real(ctx, batch))
    with Engine(*pair_paths, n_ctx=512, n_threads=2, parallel=2, cost_cache=False, calibrate=True) as engine:
        assert decoded_on and all(t is not threading.current_thread() and not t.is_alive() for t in decoded_on)
        model = engine.policy.model
        assert engine.policy.needs_costs() == (False, False) and model.learned.draft_round_cost.ready
        assert model.verify_cost.observations >= 5 and model.draft_cost.observations >= 3
        assert all(not ctx.seq_tokens(s) for ctx in engine.contexts for s in range(2))
        messages = [{"role": "user", "content": "Name three fruits."}]
        assert engine.generate(messages, max_tokens=24).text == engine.generate(messages, max_tokens=24,
                                                                                speculative=False).text
    with Engine(*pair_paths, n_ctx=512, n_threads=2, cost_cache=False) as cpu:  # the default on a CPU: none
        assert cpu.policy.needs_costs() == (True, True)


def test_a_passing_thread_hands_back_what_it_returned_or_raised():
    import threading

    from localspec.runtime.calibrate import on_a_passing_thread

    ran_on = []
    assert on_a_passing_thread(lambda: ran_on.append(threading.current_thread()) or 7) == 7
    assert ran_on[0] is not threading.current_thread() and not ran_on[0].is_alive()
    with pytest.raises(ZeroDivisionError):
        on_a_passing_thread(lambda: 1 / 0)


def test_a_decode_nobody_reads_is_waited_for_in_its_own_time(pair_paths, monkeypatch):
    """llama_decode returns before a GPU has done the work; reading logits waits for it. A prompt
    chunk's decode reads nothing: it waits for its work itself (llama_synchronize, inside the time
    counted as llama.cpp's), so a request's first step is not charged its prompt."""
    from localspec.llama import context as llama_context

    waits = []
    real = llama_context.llama_cpp.llama_synchronize
    monkeypatch.setattr(llama_context.llama_cpp, "llama_synchronize", lambda ctx: waits.append(ctx) or real(ctx))
    with LlamaModel(pair_paths[1]) as model, LlamaContext(model, n_ctx=256, n_threads=2, n_seq=2) as ctx:
        ctx.decode([1, 2, 3, 4], n_logits=0)
        assert len(waits) == 1
        ctx.decode([5], n_logits=1)  # its logits are read: that waits
        from localspec.llama.context import Rows
        ctx.decode_rows([Rows(0, [6, 7], 0), Rows(1, [8, 9, 10], 0)])
        assert len(waits) == 2 and ctx.llama_seconds > 0
        assert ctx.sample_greedy(0) and ctx.sample_top(1, 8)  # sequences picked for on the backend: alike
        ctx.decode([11, 12], n_logits=0, seq=0)
        ctx.decode([13], n_logits=0, seq=1)
        assert len(waits) == 4


def test_a_draft_takes_the_oracles_cache_of_the_prompt_where_their_layouts_match(pair_paths):
    """A quantized copy of the oracle lays its KV cache out like the oracle: its catch-up on a
    prompt copies the oracle's cache (llama.cpp's sequence state) instead of evaluating it. With
    another layout (flash attention on for the draft only: V is not transposed) llama.cpp refuses
    the copy and the draft evaluates the prompt itself, from then on."""
    om, dm = LlamaModel(pair_paths[0]), LlamaModel(pair_paths[1])
    oracle = LlamaContext(om, n_ctx=256, n_threads=2, flash_attn="off")
    try:
        history = om.tokenize("A fox, a dog and a cat walk along the river bank at dawn. " * 3)
        oracle.decode(history[:-1], n_logits=0)  # the oracle holds all but the last token
        for fa, taken in (("off", True), ("on", False)):
            draft = LlamaContext(dm, n_ctx=256, n_threads=2, flash_attn=fa)
            try:
                proposer = DraftModelProposer(draft, cache_source=oracle)
                proposer.start(catch_up=True)
                d = proposer.propose(history, 3, SamplingParams(), np.random.default_rng(0))
                assert len(d) == 3 and draft.seq_tokens()[:len(history)] == history
                assert (d.evaluated == 1 + 2) == taken  # the last token, then a decode per drafted token but the last
                assert (proposer.cache_source is oracle) == taken
                assert d.evaluated >= len(history) or taken  # refused: it evaluated the prompt itself
            finally:
                draft.close()
    finally:
        oracle.close()
        om.close()
        dm.close()


def test_the_attention_kernel_reaches_both_contexts_and_the_stats(pair_paths):
    messages = [{"role": "user", "content": "Name three fruits."}]
    for setting, expected in (("on", "on"), ("off", "off"), ("auto", "off")):  # auto: off on a CPU build
        with Engine(*pair_paths, n_ctx=256, flash_attn=setting, draft_length=2, cost_cache=False) as engine:
            assert engine.oracle.flash_attn == engine.draft_ctx.flash_attn == expected
            r = engine.generate(messages, max_tokens=4)
            assert (r.stats.flash_attn, r.stats.draft_flash_attn) == (expected, expected)
            assert r.stats.to_dict()["flash_attn"] == expected
    with pytest.raises(ValueError, match="flash attention"):
        Engine(*pair_paths, n_ctx=256, flash_attn="fast")


def test_a_draft_that_does_not_pay_costs_nothing(pair_paths):
    """When the measured costs say drafting cannot win, the draft model is not run at all: no
    prompt evaluation on it (TTFT is the oracle's alone) and no drafting, probes aside."""
    with Engine(*pair_paths, n_ctx=512, cost_cache=False, lookup=False) as engine:
        policy = AdaptiveLength(probe_every=10_000, min_trials=0)
        for n in (1, 2, 4, 8, 16):  # a draft token dearer than 20 oracle passes
            policy.verify_cost.observe(n, 20, 0.05 * n)
            policy.draft_cost.observe(n, 20, 1.0 * n)
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
    with Engine(*pair_paths, n_ctx=512, cost_cache=False, lookup=False) as engine:
        r = engine.generate([{"role": "user", "content": "Name three fruits."}], max_tokens=12, speculative=False)
        policy = engine.policy
        assert r.stats.drafted == 0 and r.stats.steps == len(r.tokens)
        assert engine.proposer.tokens_evaluated == 0
        assert not policy.verify_cost.ready and policy.est.trials == 0 and policy.est.time_spent == 0.0


def test_after_a_pause_the_draft_keeps_the_start_it_holds_and_catches_up_on_recent_text_only(pair_paths):

    from localspec.speculative.sampling import SamplingParams

    with Engine(*pair_paths, n_ctx=512, draft_length=4, lookup=False) as engine:
        drafter, rng, greedy = engine.proposer, np.random.default_rng(0), SamplingParams()
        long = engine.oracle_model.tokenize(PASSAGE * 2, add_special=True, parse_special=False)
        drafter.ctx.sync(long[:10], n_logits=0)  # what an earlier request left in the draft's cache
        drafter.start(catch_up=False)  # a probe while idle: no catching up on all of it
        before = drafter.tokens_evaluated
        draft = drafter.propose(long, 4, greedy, rng)  # 70+ tokens to catch up: only the latest 16
        assert (drafter.keep, drafter.gap_start) == (10, len(long) - 16)
        assert drafter.ctx.seq_tokens()[:26] == long[:10] + long[-16:]  # the prompt's start, a gap, the recent text
        assert drafter.tokens_evaluated - before == 16 + len(draft) - 1
        more = long + [int(draft.tokens[0]), long[20]]  # the first draft token accepted, then a recovered one
        drafter.propose(more, 4, greedy, rng)  # drafting goes on after the gap: no new window
        assert (drafter.keep, drafter.gap_start) == (10, len(long) - 16)
        assert drafter.ctx.seq_tokens()[:28] == long[:10] + more[-18:]

        short = engine.oracle_model.tokenize("Name three fruits.", add_special=True, parse_special=False)
        drafter.start(catch_up=False)  # a new prompt: the gap is forgotten
        assert drafter.keep == drafter.gap_start == 0
        assert len(drafter.propose(short, 4, greedy, rng)) >= 1
        assert drafter.ctx.seq_tokens()[:len(short)] == short

        drafter.start(catch_up=True)  # drafting pays: the first proposal evaluates all it has not seen
        before = drafter.tokens_evaluated
        draft = drafter.propose(long, 4, greedy, rng)
        assert drafter.ctx.seq_tokens()[:len(long)] == long
        assert drafter.tokens_evaluated - before == draft.evaluated >= len(long) - 1

        # drafting paid when the request began, then nothing was drafted for 70+ tokens (the policy
        # idled, or plain batching ran): the whole prompt, then the latest 16 tokens only
        answer = short + long[1:]
        drafter.start(catch_up=True, prompt=len(short))
        before = drafter.tokens_evaluated
        draft = drafter.propose(answer, 4, greedy, rng)
        assert (drafter.keep, drafter.gap_start) == (len(short), len(answer) - 16)
        assert drafter.ctx.seq_tokens()[:len(short) + 16] == short + answer[-16:]
        assert drafter.tokens_evaluated - before == draft.evaluated <= len(short) + 16 + len(draft)
        drafter.start(catch_up=True, prompt=len(short))  # a few tokens past the prompt: all of it
        draft = drafter.propose(answer[:len(short) + 10], 4, greedy, rng)
        assert drafter.ctx.seq_tokens()[:len(short) + 10] == answer[:len(short) + 10]


def test_vocabulary_digests_agree_with_the_token_by_token_check(registry, pair_paths):
    """The header's vocabulary digest stands in for llama.cpp's token-by-token comparison: equal for
    the SmolLM2 files (which that comparison passes), different from Gemma's (which it fails)."""
    from localspec.speculative.compat import first_difference

    with LlamaModel(pair_paths[0]) as oracle, LlamaModel(pair_paths[1]) as draft, \
            LlamaModel(registry.resolve("gemma-3-270m-q4_k_m")) as gemma:
        assert oracle.vocab_digest is not None and oracle.vocab_digest == draft.vocab_digest != gemma.vocab_digest
        draft.vocab_digest = None  # unknown: compared token by token
        assert first_difference(oracle, draft) is None
        assert first_difference(oracle, gemma) is not None


def test_incompatible_pair_refused_without_cross_tokenizer(registry, pair_paths):
    with pytest.raises(IncompatibleModels, match="cannot draft for oracle"):
        Engine(registry.resolve("gemma-3-270m-q4_k_m"), pair_paths[1], n_ctx=512)


def test_cross_tokenizer_draft_keeps_greedy_output_the_oracles(registry, pair_paths, monkeypatch):
    gemma = registry.resolve("gemma-3-270m-q4_k_m")
    prompts = ["The capital of France is Paris. The capital of Germany is",
               "Once upon a time, there was a little girl who",
               "def fibonacci(n):\n"]
    with Engine(gemma, pair_paths[1], n_ctx=1024, cross_tokenizer=True, draft_length=4, lookup=False) as cross:
        assert isinstance(cross.proposer, CrossTokenizerProposer)
        steps = []
        original = cross.stepper.accept

        def recording(tokens, probs, logits, sampling, rng, *, picked=None, **kw):
            out, n = original(tokens, probs, logits, sampling, rng, picked=picked, **kw)
            steps.append(((logits.argmax(axis=1) if picked is None else picked).copy(), out.copy()))
            return out, n

        monkeypatch.setattr(cross.stepper, "accept", recording)
        accepted = 0
        for p in prompts:
            spec = cross.generate(p, max_tokens=32)
            base = cross.generate(p, max_tokens=32, speculative=False)
            accepted += spec.stats.accepted
            # batched logits differ slightly from one-token logits: the texts may part only at a near-tie
            i = next((j for j, (a, b) in enumerate(zip(spec.tokens, base.tokens)) if a != b), None)
            if i is not None:
                cross.oracle.reset()
                cross.oracle.sample_greedy(0, False)  # the row's logits, not the pick a request took
                row = np.array(cross.oracle.decode(cross.tokenize_prompt(p) + base.tokens[:i]))[0]
                assert abs(row[base.tokens[i]] - row[spec.tokens[i]]) < 0.15, f"{p!r} parts at token {i}: not a near-tie"
        for argmax, out in steps:
            assert out.tolist() == argmax[:len(out)].tolist()  # every emitted token is the oracle's argmax
    assert accepted > 0  # the re-tokenized drafts do get accepted


def test_a_hybrids_draft_model_keeps_its_costs_under_its_own_kind(registry, pair_paths, tmp_path, monkeypatch):
    """With prompt lookup beside it (the default), a draft model's learned costs and acceptance are
    kept as they would be without it: a same-vocabulary draft's as a plain model's, one drafting
    through text as a cross-tokenizer draft's (re-tokenizing costs time); the lookup's apart."""
    monkeypatch.setenv("LOCALSPEC_COST_CACHE", str(tmp_path))
    gemma = registry.resolve("gemma-3-270m-q4_k_m")
    for oracle, kind in ((pair_paths[0], "model"), (gemma, "cross-tokenizer")):
        with Engine(oracle, pair_paths[1], n_ctx=256, cross_tokenizer=True) as engine:
            assert engine.proposer.describe() == "hybrid" and engine.proposer.model.describe() == kind
            keys = engine.learner.costs.keys
            assert keys["draft"]["proposer"] == keys["acceptance"]["proposer"] == kind
            assert keys["lookup_acceptance"]["proposer"] == "hybrid-lookup"


def test_auto_follows_the_kernel_check_measured_here(pair_paths, tmp_path, monkeypatch):
    """`localspec check` records the faster attention kernel for this oracle, threads and machine;
    --flash-attn auto uses it from then on (and the rule, off on a CPU, without a record)."""
    from localspec.runtime.factory import kernel_identity
    from localspec.runtime.learning import CostStore

    monkeypatch.setenv("LOCALSPEC_COST_CACHE", str(tmp_path))
    with Engine(pair_paths[0], None, n_ctx=256, n_threads=2) as engine:
        assert engine.oracle.flash_attn == "off"
        key = kernel_identity(pair_paths[0], n_threads=engine.n_threads, gpu_layers=engine.gpu_layers)
    CostStore(tmp_path).save("kernel", key, {"flash_attn": "on"})
    with Engine(pair_paths[0], None, n_ctx=256, n_threads=2) as engine:
        assert engine.oracle.flash_attn == "on"
    with Engine(pair_paths[0], None, n_ctx=256, n_threads=1) as engine:  # another setting: not measured
        assert engine.oracle.flash_attn == "off"
    with Engine(pair_paths[0], None, n_ctx=256, n_threads=2, flash_attn="off") as engine:  # asked for: as asked
        assert engine.oracle.flash_attn == "off"


def test_check_reports_the_fitted_costs_and_records_the_faster_kernel(tmp_path, monkeypatch):
    import json

    from click.testing import CliRunner

    from localspec.cli.commands import main

    monkeypatch.setenv("LOCALSPEC_COST_CACHE", str(tmp_path))
    result = CliRunner().invoke(main, ["check", "--max-prompts", "1", "--max-tokens", "16", "--threads", "2",
                                       "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["compatible"] and set(report["measured"]) == {"k=4", "k=8", "adaptive"}
    assert set(report["fitted"]) == {"256", "1024", "2048"} and report["draft_cost_ms"] > 0
    for row in report["fitted"].values():
        costs = list(row.values())
        assert costs == sorted(costs) and costs[0] > 0  # a longer pass never costs less
    assert report["kernel"]["chosen"] in ("on", "off")
    assert set(report["kernel"]["ms"]["on"]) == {"1@256", "9@256", "1@1024", "9@1024"}
    greedy = [r for r in report["regimes"] if r["regime"] == "greedy"]  # what the policy knows, per regime
    assert {r["source"] for r in greedy} <= {"draft model", "prompt lookup"} and greedy[0]["trials"] > 0
    assert all((r["why_idle"] is None) == r["drafting"] for r in report["regimes"])
    assert set(report["adaptive_idle"]) == {"idle_steps", "steps", "reason"}
    with Engine(*[str(p) for p in (report["oracle"],)], None, n_ctx=256, n_threads=2) as engine:
        assert engine.oracle.flash_attn == report["kernel"]["chosen"]  # auto now follows the measurement


def test_the_drafts_catch_up_on_the_prompt_is_after_the_first_token_and_counts_in_the_speed(pair_paths):
    """The draft catches up on the prompt in its first proposal (after the first token, so it does
    not delay it): that time is in the step's record and the request's draft time, and, unlike the
    oracle's prompt evaluation, inside the generation speed (only speculation pays it). Here it
    evaluates the prompt itself (the oracle's cache is not offered)."""
    with Engine(*pair_paths, n_ctx=512, draft_length=4, cost_cache=False, lookup=False) as engine:
        engine.proposer.cache_source = None
        r = engine.generate([{"role": "user", "content": "Name three fruits and say why you like them."}],
                            max_tokens=24)
        s = r.stats
        first = s.records[1]
        assert first.draft_evaluated >= s.prompt_tokens - 1 and first.draft_prompt_time > 0
        assert first.draft_prompt_time <= first.draft_time
        assert all(x.draft_prompt_time == 0 for x in s.records[2:])
        assert s.draft_prompt_time == pytest.approx(first.draft_prompt_time)
        assert s.time_to_first_token < s.prompt_time + first.verify_time + first.draft_time
        assert s.generation_time == pytest.approx(s.total_time - s.prompt_time)
        assert s.tokens_per_second == pytest.approx(s.completion_tokens / s.generation_time)


def greedy_estimates(engine) -> list[tuple]:
    """What each source's policy learned of the greedy regime: (source, acceptance, tokens judged)."""
    return [(r["source"], r["acceptance"], r["trials"]) for r in engine.policy.known_regimes() if r["regime"] == "greedy"]


def test_sampled_requests_leave_greedy_ones_drafting(pair_paths, tmp_path, monkeypatch):
    """Issue 33's experiment, shortened, on the default pair: a greedy chat request, a dozen short
    requests at temperature 1 (what an OpenAI client sends when it sets none), then the greedy
    request again. The sampled requests teach the greedy regime's estimates nothing, and the greedy
    request drafts about as much as the first time (one estimate for every request had it draft 6
    tokens of 128 against 119) with the same text; so does a fresh engine on the kept state. Each
    request's stats name its regime.

    How much a request drafts also rests on the pass costs every request measures, and on this
    shared 2-core VM a stall while they are measured can price the draft out for a request (the
    policy re-tries at later ones): with a busy loop on the other core for 0.3 s of every second, the
    greedy request drafted less than half as much as before them in 2 of 9 runs of ce55e58 and 3 of
    12 of the code after it. So the drafting is asked of two tries, each on a cost store of its own;
    the estimates, which no timing moves, of every try."""
    prompt = [{"role": "user", "content": "Give me five tips for staying focused while studying."}]
    for attempt in range(2):
        monkeypatch.setenv("LOCALSPEC_COST_CACHE", str(tmp_path / str(attempt)))
        with Engine(*pair_paths, n_ctx=1024) as engine:
            first = engine.generate(prompt, max_tokens=96)
            before = greedy_estimates(engine)
            for topic in ("octopuses", "autumn", "bees", "the sea") * 3:
                r = engine.generate([{"role": "user", "content": f"Tell me about {topic}."}], max_tokens=32,
                                    temperature=1.0)
                assert r.stats.regime == "temperature 0.85-1.15"
            assert greedy_estimates(engine) == before and before  # the sampled requests taught the greedy regime nothing
            after = engine.generate(prompt, max_tokens=96)
        assert first.stats.regime == after.stats.regime == "greedy"
        assert after.text == first.text
        if after.stats.drafted >= 0.5 * first.stats.drafted > 0:
            break
    else:
        pytest.fail(f"the greedy request drafted {after.stats.drafted} tokens after the sampled ones, against "
                    f"{first.stats.drafted} before them, in both tries")
    with Engine(*pair_paths, n_ctx=1024) as fresh:
        again = fresh.generate(prompt, max_tokens=96)
    assert again.text == first.text and again.stats.drafted >= 0.5 * first.stats.drafted
