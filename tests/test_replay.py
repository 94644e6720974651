"""The length policy replayed on recorded traces (localspec.bench.replay): no timing, no model.

tests/data/traces/smollm2.json was recorded by scripts/record_traces.py on the default pair (six
held-out chat prompts, 400-token greedy answers at most) with the cost table of the machine it ran
on (named in the file); `Costs.gpu_like` prices the same traces as a workstation GPU would, with an
8B oracle, and `Costs.h200_smollm2` as the default pair ran on an H200 (a draft token dearer than the
oracle's one-token pass). On a GPU the replay times both models at load, as the engine does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from localspec.bench.replay import Costs, Table, Trace, hindsight, load_traces, measured_costs, replay
from localspec.runtime.factory import hybrid_policy
from localspec.speculative.policy import AdaptiveLength, FixedLength

TRACES = Path(__file__).parent / "data" / "traces" / "smollm2.json"
POOR_TRACES = Path(__file__).parent / "data" / "traces" / "smollm2-q2k.json"  # the same prompts, the Q2_K draft
FIXED = (1, 2, 3, 4, 6, 8, 12, 16)


@pytest.fixture(scope="module")
def recording():
    return load_traces(TRACES)


@pytest.fixture(scope="module")
def poor_recording():
    return load_traces(POOR_TRACES)


def default_policy(doc: dict):
    """The engine's default for the pair: the hybrid of the draft model and prompt lookup."""
    return hybrid_policy(AdaptiveLength(k_max=16, draft_cost_ratio=doc["draft_cost_ratio"]))


def flat_costs() -> Costs:
    table = Table((0, 4096), (1, 17), np.array([[10.0, 10.0], [10.0, 10.0]]))
    return Costs("flat", table, Table((0, 4096), (1, 17), np.array([[2.0, 2.0], [2.0, 2.0]])))


def synthetic(agree: int, sure: float = 1.0, n: int = 41) -> Trace:
    return Trace("synthetic", (5, 6, 7), tuple(range(100, 100 + n)), np.full(n - 1, agree),
                 np.full((n - 1, 16), sure), max_tokens=n)


def test_a_replayed_step_drafts_what_the_trace_says_and_is_charged_its_passes():
    trace = synthetic(agree=16)
    result = replay(trace, FixedLength(4), flat_costs(), lookup=False)
    # the first token from the prompt's pass, then 5 tokens a step (4 accepted + the bonus): 40 in 8 steps
    assert (result.tokens, result.steps, result.drafted, result.accepted) == (41, 9, 32, 32)
    first = 0.010
    # each step: a catch-up decode and 3 more (2 ms each), a verify pass (10 ms)
    assert result.seconds == pytest.approx(first + 8 * (4 * 0.002 + 0.010))


def test_the_draft_stops_after_its_first_unsure_token_and_only_agreeing_tokens_are_accepted():
    trace = synthetic(agree=2)
    trace.sure[:, 4] = 0.1  # the fifth token is under p_min: drafted, then the draft stops
    result = replay(trace, FixedLength(16), flat_costs(), lookup=False, p_min=0.3)
    steps = result.records[1:6]  # (the last steps are cut short by max_tokens)
    assert {(s.drafted, s.accepted) for s in steps} == {(5, 2)}
    assert result.tokens == 41


def test_the_replay_runs_the_engines_own_step(monkeypatch):
    """The replay has no step of its own: a step whose plan drops the policy's drafts shows in it."""
    from localspec.runtime.step import Step
    from localspec.speculative.plan import NO_DRAFT

    real = Step._plan

    def dropping(self, running, **kw):
        props = real(self, running, **kw)
        for prop in props.values():
            prop.plan = NO_DRAFT
        return props

    monkeypatch.setattr(Step, "_plan", dropping)
    result = replay(synthetic(agree=16), FixedLength(4), flat_costs(), lookup=False)
    assert (result.tokens, result.steps, result.drafted) == (41, 41, 0)


def speed(trace, policy, costs, **kw) -> float:
    return replay(trace, policy, costs, **kw).tokens_per_second


def best_fixed(trace, costs) -> tuple[float, str]:
    """The best of K = 0 and every fixed K, with the draft model alone and with prompt lookup beside it."""
    runs = [(speed(trace, FixedLength(0), costs, lookup=False), "k0")]
    for k in FIXED:
        runs.append((speed(trace, FixedLength(k), costs, lookup=False), f"k{k}"))
        runs.append((speed(trace, FixedLength(k), costs), f"k{k}+lookup"))
    return max(runs)


COSTS = ["measured", "gpu-like"]


def costs_of(name: str, doc: dict) -> Costs:
    return measured_costs(doc) if name == "measured" else Costs.gpu_like()


@pytest.mark.parametrize("profile", COSTS)
def test_the_adaptive_policy_keeps_up_with_the_best_fixed_length_once_it_has_learned(recording, profile):
    """An engine that served the other requests already (a server; a process after the cost cache's
    earlier ones): every trace at least 0.97x the best fixed configuration for that trace."""
    traces, doc = recording
    assert_learned_keeps_up(traces, doc, costs_of(profile, doc))


def assert_learned_keeps_up(traces, doc, costs, share: float = 0.97, bests=None) -> None:
    """The default policy, having served every trace once (what a running server has learned),
    runs each again at least `share` of the best fixed configuration for it (`bests`: those,
    where the caller has them already)."""
    policy = default_policy(doc)
    for trace in traces:
        replay(trace, policy, costs)
    for trace, (best, name) in zip(traces, bests or [best_fixed(trace, costs) for trace in traces]):
        got = speed(trace, policy, costs)
        assert got >= share * best, f"{trace.prompt[:40]!r}: {got:.1f} tok/s against {name}'s {best:.1f}"


@pytest.mark.parametrize("profile", COSTS)
def test_a_fresh_policy_pays_little_to_learn(recording, profile):
    """A process with no learned state: within 10% of the best fixed configuration from the first
    request on (short answers included: 78 tokens, a dozen steps)."""
    traces, doc = recording
    costs = costs_of(profile, doc)
    for trace in traces:
        best, name = best_fixed(trace, costs)
        got = speed(trace, default_policy(doc), costs)
        assert got >= 0.90 * best, f"{trace.prompt[:40]!r}: {got:.1f} tok/s against {name}'s {best:.1f}"


@pytest.mark.parametrize("profile", COSTS)
def test_a_draft_that_rarely_agrees_is_left_idle(recording, profile):
    """The same texts with a draft that agrees with the oracle at one position in five (a badly
    matched pair): the policy gets within 3% of the best, which is K = 0 or close to it."""
    traces, doc = recording
    rng = np.random.default_rng(0)
    poor = [dataclasses.replace(t, agree=np.where(rng.random(len(t.agree)) < 0.2, t.agree, 0)) for t in traces]
    assert_learned_keeps_up(poor, doc, costs_of(profile, doc))


@pytest.mark.parametrize("profile", COSTS)
def test_no_fixed_length_of_the_draft_model_beats_hindsight(recording, profile):
    traces, doc = recording
    costs = costs_of(profile, doc)
    for trace in traces:
        ceiling = hindsight(trace, costs)
        assert ceiling.tokens == len(trace.answer)
        for k in FIXED:
            assert speed(trace, FixedLength(k), costs, lookup=False) <= ceiling.tokens_per_second * 1.001


@pytest.mark.parametrize("profile", COSTS)
def test_a_shared_machines_noisy_timings_do_not_idle_a_paying_draft(recording, profile):
    """Each pass's time off by a lognormal factor (sigma 0.3) and 3% of passes three times as long,
    as on a busy 2-core VM: the costs fitted from such steps must not price a paying draft out (a
    per-decode draft cost did: one fit put a 9-token draft at 614 ms against 143, and 38% of the
    steps went idle). Over every trace twice, six machines' worth of noise."""
    traces, doc = recording
    costs = costs_of(profile, doc)
    idle = steps = 0
    ratios = []
    for seed in range(6):
        rng = np.random.default_rng(seed)
        policy = default_policy(doc)
        adaptive = fixed = 0.0
        for _ in range(2):
            for trace in traces:
                run = replay(trace, policy, costs, noise=0.3, stalls=0.03, rng=rng)
                fixed += replay(trace, FixedLength(16), costs, lookup=False, noise=0.3, stalls=0.03, rng=rng).seconds
                adaptive += run.seconds
                idle += sum(1 for r in run.records[1:] if not r.drafted)
                steps += run.steps
        ratios.append(fixed / adaptive)  # the same tokens: the speed ratio
    assert idle <= 0.10 * steps, f"{idle} of {steps} steps idle"
    assert np.mean(ratios) >= 0.95 and min(ratios) >= 0.88, ratios


def test_where_the_draft_costs_as_much_as_the_oracle_the_default_never_loses(recording):
    """The default pair on an H200 (../shared/gpu/h200-2026-11-27): both models launch-bound, a draft
    token dearer than a one-token oracle pass, a pass of two tokens 2.5x one. The best is the oracle
    alone (K = 0) on every trace, but for prompt lookup's long copies; the default, fresh (its costs
    timed at load) >= 0.95x of the best of K = 0 and every fixed K on every trace (0.979x at worst),
    and once it has served the others >= 0.98x (0.989x at worst). (It ran 0.76-0.96x fresh before it
    could tell that no acceptance makes such a draft pay.)"""
    traces, doc = recording
    costs = Costs.h200_smollm2()
    for trace in traces:
        best, name = best_fixed(trace, costs)
        got = speed(trace, default_policy(doc), costs)
        assert got >= 0.95 * best, f"fresh, {trace.prompt[:40]!r}: {got:.1f} tok/s against {name}'s {best:.1f}"
    assert_learned_keeps_up(traces, doc, costs, share=0.98)


def test_on_a_gpu_the_replay_times_both_models_at_load_as_the_engine_does(recording):
    """Before its first step a fresh policy knows the card's costs: a one-token pass cheaper than a
    two-token one, a draft token as dear as the table says. A CPU's table is learned from the steps."""
    traces, doc = recording
    costs = Costs.h200_smollm2()
    policy = default_policy(doc)
    assert policy.needs_costs() == (True, True)
    costs.calibrate(policy)
    assert policy.needs_costs() == (False, False)
    model = policy.model
    assert model.verify_cost(2, 64) > 2 * model.verify_cost(1, 64)
    assert model.draft_cost(9, 64) == pytest.approx(costs.proposal(8, 2, 64), rel=0.15)
    assert not measured_costs(doc).gpu


@pytest.mark.parametrize("profile", COSTS + ["h200"])
def test_a_real_poor_draft_is_used_where_it_pays_and_never_loses(poor_recording, profile):
    """The other tests' poor draft is the good one's agreement thinned out at random, its confidence
    untouched; a real poor one is unsure where it is wrong. tests/data/traces/smollm2-q2k.json is the
    default pair's six prompts with the Q2_K draft (recorded by scripts/record_traces.py --pair
    smollm2-q2k on a 2-core Xeon VM): ~70% first-token agreement, and of its tokens under a top
    probability of 0.3 fewer than half agree (37%; the Q4_1 draft's: 86%). Every trace, fresh >= 0.90x and
    warm >= 0.95x the best of K = 0 and every fixed K (0.90 / 0.958 at worst at c4efe57); on the H200
    table, where the oracle alone is the best fixed choice, >= 0.97x fresh and >= 0.98x warm."""
    traces, doc = poor_recording
    costs = Costs.h200_smollm2() if profile == "h200" else costs_of(profile, doc)
    fresh_share, warm_share = (0.97, 0.98) if profile == "h200" else (0.90, 0.95)
    bests = [best_fixed(trace, costs) for trace in traces]
    for trace, (best, name) in zip(traces, bests):
        got = speed(trace, default_policy(doc), costs)
        assert got >= fresh_share * best, f"fresh, {trace.prompt[:40]!r}: {got:.1f} tok/s against {name}'s {best:.1f}"
    assert_learned_keeps_up(traces, doc, costs, share=warm_share, bests=bests)


@pytest.mark.parametrize("host_ms", [0.4, 0.1])
def test_an_oracle_of_an_8b_models_cost_is_drafted_for_and_a_poor_draft_never_loses(recording, poor_recording, host_ms):
    """Issue 50's pair as ESTIMATED on an H200 (`Costs.h200_as_8b`: the 8B-shaped oracle's pass
    from its weights' bytes, the draft as the H200 ran it), with the host's time per drafted token
    as measured there with whole rows (0.4 ms) and as the device's top-k picks are meant to make it
    (0.1 ms). The good draft, fresh: >= 1.45x the oracle alone on every trace (1.47x at worst) and
    >= 0.90x the best of K = 0 and every fixed K (0.92x); the poor Q2_K draft: never below 0.97x
    the oracle alone (0.994x at worst) and >= 0.85x the best (0.87x; it idles where its estimate
    predicts under the 10% a start of drafting needs, and the best fixed K gains 14% with lookup)."""
    costs = Costs.h200_as_8b(host_draft_token=host_ms / 1000)
    for (traces, doc), gain, share in ((recording, 1.45, 0.90), (poor_recording, 0.97, 0.85)):
        for trace in traces:
            alone = speed(trace, FixedLength(0), costs, lookup=False)
            best, name = best_fixed(trace, costs)
            got = speed(trace, default_policy(doc), costs)
            assert got >= gain * alone, f"{trace.prompt[:40]!r}: {got / alone:.3f}x the oracle alone"
            assert got >= share * best, f"{trace.prompt[:40]!r}: {got:.1f} tok/s against {name}'s {best:.1f}"
