"""Draft-length policies on synthetic costs and acceptance."""

import dataclasses
import re

import numpy as np
import pytest

from localspec.outputs import DraftSource, OfferScore, StepRecord
from localspec.speculative.plan import Found, Offer
from localspec.speculative.policy import (ACCEPTANCE_LAYOUT, GREEDY, LOOKUP_PRIORS, LOOKUP_RUNS, AdaptiveLength, Estimates, FixedLength,
                              HybridLength, Regime)

CONTEXT = 100
FRESH, ALIGNED, LATER = 0, 1, 2  # AcceptanceByPlace's keys for a draft model


def primed(verify, draft_cost, k_max=16, **kw):
    """A policy whose cost models have seen synthetic steps: an oracle pass of n tokens costs
    verify(n), and the draft draft_cost per token it evaluates; it catches up on two tokens (the last
    step's accepted one and its bonus) before it drafts, so a draft of l tokens costs (l + 1) *
    draft_cost, at one context length."""
    policy = AdaptiveLength(k_max=k_max, **kw)
    policy.learned.catch_up = 2.0
    for _ in range(3):
        for n in (1, 2, 4, 8, 16):
            policy.verify_cost.observe(n, CONTEXT, verify(n))
            policy.draft_cost.observe(n + 1, CONTEXT, (n + 1) * draft_cost)
    policy.outlook.context = CONTEXT
    return policy


def step(drafted, accepted, draft_time, verify_time, context=CONTEXT, k=None):
    return StepRecord(k=drafted if k is None else k, drafted=drafted, accepted=accepted, draft_time=draft_time,
                      verify_time=verify_time, context=context, draft_evaluated=drafted + 1 if drafted else 0)


def test_fixed_length_caps_at_limit_and_takes_the_lookups_tokens_where_it_found_some():
    p = FixedLength(8)
    model = Offer(model=True)
    assert [p.plan(model, limit).length for limit in (20, 3, 0)] == [8, 3, 0]
    assert p.plan(model, 20).source == "model" and p.plan(model, 0).source == ""
    found = Offer(lookup=Found(np.arange(5, dtype=np.int32), 3), model=True)
    assert (p.plan(found, 20).source, p.plan(found, 20).length, p.plan(found, 4).length) == ("lookup", 5, 4)
    assert not p.plan(Offer(), 20).drafts  # nothing to draft with
    with pytest.raises(ValueError):
        FixedLength(-1)


def test_expected_tokens_formula():
    p = AdaptiveLength(k_max=4, prior_acceptance=0.5)
    assert p.outlook.expected_tokens(0) == 1
    assert p.outlook.expected_tokens(1) == pytest.approx(1.5)
    assert p.outlook.expected_tokens(3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_useless_draft_gives_k0():
    verify = lambda n: 0.024 + 0.002 * n  # noqa: E731  cheap-ish verify
    p = primed(verify, draft_cost=0.010)
    for _ in range(40):  # every draft token rejected
        p.observe(step(4, 0, 0.04, verify(5)))
    assert p.outlook.best_length(16) == 0
    assert p.draft_length(16, CONTEXT) == 0


def test_a_marginal_predicted_gain_is_not_worth_drafting():
    verify = lambda n: 0.030 + 0.004 * (n - 1)  # noqa: E731
    assert primed(verify, 0.008, prior_acceptance=0.68, min_gain=0.0).outlook.best_length(16) == 2  # +3% predicted
    assert primed(verify, 0.008, prior_acceptance=0.7).outlook.best_length(16) == 0  # +5%: within min_gain (10%)
    assert primed(verify, 0.008, prior_acceptance=0.78).outlook.best_length(16) == 3  # +15% predicted


def test_high_acceptance_and_cheap_verify_gives_large_k():
    verify = lambda n: 0.020 + 0.0005 * n  # noqa: E731  GPU-like: a wide pass costs little more
    p = primed(verify, draft_cost=0.001)
    for _ in range(60):
        p.observe(step(16, 16, 0.016, verify(17)))
    assert p.outlook.best_length(16) >= 12


def test_expensive_verify_keeps_k_small_even_with_good_acceptance():
    verify = lambda n: 0.010 * n  # noqa: E731  compute-bound: a pass costs in proportion to its size
    p = primed(verify, draft_cost=0.004)
    for _ in range(60):
        p.observe(step(4, 4, 0.016, verify(5)))
    assert p.outlook.best_length(16) == 0  # speculation can never win when verify is linear from zero


def test_k_is_capped_by_limit_and_k_max():
    p = primed(lambda n: 0.02 + 0.0001 * n, draft_cost=0.0001, k_max=6, prior_acceptance=0.99)
    assert p.draft_length(100, CONTEXT) == 6
    assert p.draft_length(3, CONTEXT) == 3
    assert p.draft_length(0, CONTEXT) == 0


def test_probes_now_and_then_within_a_time_budget():
    verify = lambda n: 0.024 + 0.002 * n  # noqa: E731
    p = primed(verify, draft_cost=0.010, probe_every=5, probe_length=2, probe_budget=0.02)
    for _ in range(40):
        p.observe(step(4, 0, 0.04, verify(5)))
    probes = []
    for i in range(3000):
        k = p.draft_length(16, CONTEXT)
        assert k in (0, 2)
        if k:  # a probe is dear: the draft catches up on the text it skipped
            probes.append(i)
            p.observe(step(2, 0, 0.2, verify(3)))
        else:
            p.observe(step(0, 0, 0.0, verify(1)))
    assert probes[0] == 4  # the first after probe_every idle steps
    assert 3 <= len(probes) <= 10  # then as often as the budget allows: ~2% of ~80 s, 0.2 s each
    assert p.est.probe_time <= 0.02 * p.est.time_spent + 0.21
    assert p.outlook.best_length(16) == 0


def idle_pair(verify, **kw):
    """A primed policy that judged every draft token of 40 steps a rejection: idle."""
    p = primed(verify, draft_cost=0.010, probe_every=5, probe_length=2, **kw)
    for _ in range(40):
        p.observe(step(4, 0, 0.04, verify(5)))
    assert p.idle
    return p


def run_idle(p, verify, n_steps, probe_cost=0.2):
    """n_steps of an idle policy (each probe costing probe_cost to draft): the steps that probed."""
    probes = []
    for i in range(n_steps):
        if p.draft_length(16, CONTEXT):
            probes.append(i)
            p.observe(step(2, 0, probe_cost, verify(3)))
        else:
            p.observe(step(0, 0, 0.0, verify(1)))
    return probes


def test_the_probe_budget_is_kept_between_processes():
    """Short processes on a pair known idle (one-shot `generate`s of ~100 tokens): each fresh
    policy used to probe at its `probe_every`th step, however short the process, so probes took
    far more than their budget; with the account kept, they take about the budget over all."""
    verify = lambda n: 0.024 + 0.002 * n  # noqa: E731
    state = idle_pair(verify, probe_budget=0.02).cost_state()["acceptance"]
    n_probes = 0
    for _ in range(30):  # 30 processes of 100 steps, ~2.6 s each
        p = idle_pair(verify, probe_budget=0.02)
        p.load_cost_state("acceptance", state)
        n_probes += len(run_idle(p, verify, 100))
        state = p.cost_state()["acceptance"]
    assert 5 <= n_probes <= 10  # ~2% of ~80 s at ~0.2 s each; 30 when every process probed once
    assert p.est.probe_time <= 0.02 * p.est.time_spent + 0.21  # over all the processes: one probe over at most


def greedy_state(**changes):
    """An acceptance state holding the greedy regime's prior estimates, with `changes`."""
    return {"layout": ACCEPTANCE_LAYOUT, "catch_up": 1.5,
            "regimes": [{**GREEDY.state(), **Estimates(0.9, 1.0).state(), **changes}]}


def test_a_malformed_probe_account_is_refused():
    for bad in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError):
            AdaptiveLength().load_cost_state("acceptance", greedy_state(time_spent=bad))
    p = AdaptiveLength()
    p.load_cost_state("acceptance", greedy_state(time_spent=10.0, probe_time=50.0))
    assert p.est.probe_time == 10.0  # probes cannot have taken more than all the time


def test_unused_probe_budget_does_not_pile_up():
    """After a long stretch of drafting, an idle policy probes at the budget's pace, not in a
    burst that spends all the budget the drafting steps left unused."""
    verify = lambda n: 0.024 + 0.002 * n  # noqa: E731
    p = idle_pair(verify, probe_budget=0.02, probe_bank=10.0)
    p.est.time_spent += 1000.0  # e.g. hours of drafting in earlier processes: 20 s of budget unused
    p.est.cap_probe_bank(p.outlook.probe_budget, p.probe_bank)
    probes = run_idle(p, verify, 1000)  # ~26 s
    assert 2 <= len(probes) <= 4  # ~2% of (10 + 26) s, 0.2 s each; ~100 (every 5th step) uncapped


def test_the_end_of_a_generation_is_not_taken_for_a_pair_that_does_not_pay():
    """With one token left to draft (max_tokens near), no draft pays; that says nothing of the pair:
    the policy must not rest as if idle, so the next request drafts from its first step (it used to
    sit out up to `recheck_every` - 1 steps of it)."""
    verify = lambda n: 0.020 + 0.002 * (n - 1)  # noqa: E731
    p = primed(verify, 0.008, prior_acceptance=0.95)
    p.est.fresh_trials = p.est.trials = 50
    assert p.outlook.best_length(1, CONTEXT) == 0 < p.outlook.best_length(16, CONTEXT)
    assert p.draft_length(1, CONTEXT) == 0
    p.observe(step(0, 0, 0.0, verify(1)))
    p.outlook.start()
    assert p.draft_length(64, CONTEXT) == p.outlook.best_length(16, CONTEXT) > 0


def test_a_lookups_short_offers_that_do_not_pay_count_toward_its_probes():
    """A lookup's offer (a match of 3 tokens) too short to pay is a judgement on the lookup, unlike
    the generation's end: its idle steps count, so it still probes now and then."""
    verify = lambda n: 0.020 + 0.002 * (n - 1)  # noqa: E731
    p = primed(verify, 0.0002, prior_acceptance=0.2, model_draft=False, probe_budget=1.0)
    p.est.fresh_trials = p.est.trials = 50
    lengths = [p.draft_length(64, CONTEXT, offered=3) for _ in range(p.probe_every)]
    assert lengths[:-1] == [0] * (p.probe_every - 1) and lengths[-1] == min(p.outlook.probe_length, 3)


def test_drafting_goes_on_at_a_smaller_predicted_gain_than_it_starts_at():
    """A policy that drafts keeps drafting while the best k is predicted to beat the oracle alone
    by keep_gain; an idle one starts only at min_gain. Between the two, the one judgement that
    crossed min_gain downward on a pair that pays (the estimates under-predict a draft that stops
    itself when unsure) used to idle it for good: idle, it no longer measured the draft."""
    verify = lambda n: 0.020 + 0.002 * (n - 1)  # noqa: E731
    drafting = primed(verify, 0.0095, prior_acceptance=0.9, keep_gain=0.05)  # predicted +7%
    drafting.est.fresh_trials = drafting.est.trials = 50
    rate = drafting.outlook.rates(16, CONTEXT)
    assert 1.05 < max(rate) / rate[0] < 1.10
    drafting.est.drafting = True  # the regime's last step drafted
    assert drafting.draft_length(16, CONTEXT) > 0
    idle = primed(verify, 0.0095, prior_acceptance=0.9, keep_gain=0.05)
    idle.est.fresh_trials = idle.est.trials = 50
    idle.est.drafting = False
    assert idle.draft_length(16, CONTEXT) == 0


def test_recovers_when_acceptance_improves():
    verify = lambda n: 0.024 + 0.002 * n  # noqa: E731
    p = primed(verify, draft_cost=0.003, probe_every=4)
    for _ in range(40):
        p.observe(step(4, 0, 0.012, verify(5)))
    assert p.outlook.best_length(16) == 0
    for _ in range(30):  # a well-matched stretch: probes get fully accepted
        k = max(p.draft_length(16, CONTEXT), 2)
        p.observe(step(k, k, 0.003 * k, verify(k + 1)))
    assert p.outlook.best_length(16) >= 4


def test_an_early_rejection_does_not_end_drafting():
    """On a pair where drafting barely pays, one rejection in the first step would tip the estimate
    to k = 0; the policy keeps drafting short until it has judged min_trials draft tokens."""
    table = {1: 0.045, 2: 0.055, 4: 0.062, 8: 0.090, 16: 0.130}
    p = primed(lambda n: table[n], draft_cost=0.025, min_trials=8)
    p.observe(step(1, 0, 0.050, 0.055))
    assert p.outlook.best_length(16) == 0 and not p.idle
    ks = []
    while p.est.trials < 8:
        k = p.draft_length(16, CONTEXT)
        ks.append(k)
        p.observe(step(k, 0, 0.050, 0.062))
    assert ks and all(k == 2 for k in ks)
    assert p.draft_length(16, CONTEXT) == 0 and p.idle  # now the evidence says drafting does not pay


def test_grows_k_from_a_short_start_when_drafts_keep_being_accepted():
    """The default pair's measured costs on a 2-core CPU (F32 oracle, Q4_1 draft): from the prior
    the policy drafts a few tokens, sees every one accepted, and moves to long drafts."""
    table = {1: 0.0236, 2: 0.0278, 4: 0.0337, 8: 0.0412, 16: 0.0601}
    p = primed(lambda n: table[n], draft_cost=0.0106)
    first = p.draft_length(16, CONTEXT)
    assert 1 <= first <= 6
    for _ in range(30):
        k = p.draft_length(16, CONTEXT)
        p.observe(step(k, k, 0.0106 * k, 0.0236 + 0.0024 * k))
    assert p.draft_length(16, CONTEXT) >= 6
    assert p.est.acceptance > 0.9


def test_acceptance_learns_fast_from_the_prior_then_holds_steady():
    p = AdaptiveLength(prior_acceptance=0.9)
    p.observe(step(8, 0, 0.0, 0.01))  # one trial: the first rejected
    assert p.est.acceptance == pytest.approx(0.9 - 0.9 / 5)  # the prior counts as 4 trials
    for _ in range(8):
        p.observe(step(1, 0, 0.0, 0.01))
    assert p.est.acceptance < 0.5  # nine rejections in a row outweigh the prior
    for _ in range(200):
        p.observe(step(4, 4, 0.0, 0.01))
    settled = p.est.acceptance
    p.observe(step(4, 0, 0.0, 0.01))
    assert settled - p.est.acceptance == pytest.approx(0.03 * settled)  # later, one rejection moves it by 1 - decay


def test_a_new_request_retries_drafting_only_on_a_pair_that_pays_in_the_long_run():
    """A hard prompt drags the running acceptance down until the policy idles; the next request
    tries again (on its whole prompt) if the long-run acceptance says the pair pays, not otherwise."""
    verify = lambda n: 0.030 + 0.004 * (n - 1)  # noqa: E731
    usually_pays = primed(verify, 0.008, prior_acceptance=0.95)
    for _ in range(300):  # a long record of good drafts ...
        usually_pays.observe(step(4, 4, 0.040, verify(5)))
    for _ in range(12):  # ... then a hard prompt
        usually_pays.observe(step(2, 0, 0.024, verify(3)))
    assert usually_pays.idle and usually_pays.est.long_acceptance > 0.9
    usually_pays.outlook.start()
    assert not usually_pays.idle and usually_pays.draft_length(16, CONTEXT) == 2  # judged afresh
    before = usually_pays.est.acceptance
    usually_pays.observe(step(2, 2, 0.024, verify(3)))
    assert usually_pays.est.acceptance == pytest.approx(before + (1 - before) / 5 + (1 - before - (1 - before) / 5) / 6)

    close_call = primed(verify, 0.008, prior_acceptance=0.68)  # +3% predicted: never worth a re-try
    for i in range(300):  # two drafts in three accepted, after an accepted one and after a rejected one alike
        close_call.observe(step(1, (1, 1, 1, 1, 0, 0, 1, 1, 0)[i % 9], 0.016, verify(2)))
    assert close_call.idle
    close_call.outlook.start()
    assert close_call.idle and close_call.draft_length(16, CONTEXT) == 0


def test_a_draft_that_stops_early_is_charged_for_what_it_drafts():
    """E(k) and T(k) with the continuation rates: c for the draft's length, c_acc after an accepted token."""
    p = primed(lambda n: 0.02 + 0.01 * n, draft_cost=0.005, prior_acceptance=0.8)
    p.est.continuation, p.est.continuation_accepted = 0.5, 0.6
    # drafting l tokens evaluates l + 1 (a catch-up of two, then a decode per drafted token but the last)
    cost = {l: p.draft_cost(l + 1, CONTEXT) + p.verify_cost(l + 1, CONTEXT) for l in (1, 2)}
    assert p.outlook.step_time(0) == pytest.approx(p.verify_cost(1, CONTEXT))
    assert p.outlook.step_time(1) == pytest.approx(cost[1])
    assert p.outlook.step_time(2) == pytest.approx(0.5 * cost[1] + 0.5 * cost[2])  # stops after one token half the time
    assert p.outlook.expected_tokens(2) == pytest.approx(1 + 0.8 + 0.8 ** 2 * 0.6)


def test_continuation_is_learned_from_where_drafts_stop():
    p = AdaptiveLength(prior_continuation=1.0, prior_weight=4.0)
    p.last_k = 8  # the allowance granted
    p.observe(step(3, 1, 0.0, 0.01))  # went on, went on, stopped
    went_on = 1.0 + (1 - 1.0) / 5
    assert p.est.continuation == pytest.approx(went_on + (0 - went_on) / 7)
    assert p.est.continuation_accepted == 1.0  # the one accepted token was followed by another
    before = p.est.continuation
    p.last_k = 2
    p.observe(step(2, 2, 0.0, 0.01))  # the allowance used up: one event
    assert p.est.continuation == pytest.approx(before + (1 - before) / 8)


def test_a_draft_that_stops_itself_when_unsure_gets_a_long_allowance():
    """The default pair's measured costs; the draft (with its p_min cut-off) proposes 3 tokens a step
    and all are accepted. Charging every allowed token would cap k; the policy sees it is not paid for."""
    table = {1: 0.0236, 2: 0.0278, 4: 0.0337, 8: 0.0412, 16: 0.0601}
    p = primed(lambda n: table[n], draft_cost=0.0106)
    for _ in range(60):
        k = p.draft_length(16, CONTEXT)
        n = min(k, 3)
        p.observe(step(n, n, 0.0106 * n, 0.0236 + 0.0024 * n))
    assert 0.6 < p.est.continuation < 0.8
    assert p.draft_length(16, CONTEXT) == 16


def test_probes_teach_nothing_but_a_fully_accepted_one_retries_on_the_whole_text():
    """A probe drafts from a window of the text (the draft skipped the idle stretch), so it is
    accepted less often than a real draft: its outcome moves no estimate. When all its tokens are
    accepted, the next step re-tries drafting with the draft caught up on everything."""
    verify = lambda n: 0.024 + 0.002 * n  # noqa: E731
    p = primed(verify, draft_cost=0.010, probe_every=4, probe_budget=0.05)
    for _ in range(40):
        p.observe(step(4, 0, 0.04, verify(5)))
    assert p.idle
    estimates = (p.est.acceptance, p.est.long_acceptance, p.est.continuation, p.est.trials)
    probes = 0
    for _ in range(200):
        k = p.draft_length(16, CONTEXT)
        assert not p.outlook.take_resync()
        p.observe(step(k, 0, 0.05 if k else 0.0, verify(k + 1)))  # probes rejected
        probes += k > 0
    assert probes > 0 and (p.est.acceptance, p.est.long_acceptance, p.est.continuation, p.est.trials) == estimates
    while not p.draft_length(16, CONTEXT):
        p.observe(step(0, 0, 0.0, verify(1)))
    p.observe(step(2, 2, 0.05, verify(3)))  # a probe fully accepted
    assert p.est.trials == estimates[3]  # still no evidence, but ...
    k = p.draft_length(16, CONTEXT)
    assert k == p.outlook.probe_length and p.outlook.take_resync() and not p.outlook.take_resync()  # ... a re-try
    assert p.est.fresh_trials == 0
    spent = p.est.probe_time
    p.observe(step(2, 2, 0.3, verify(3), k=k))  # its catch-up is dear: charged to the probe budget ...
    # ... what it cost beyond the oracle alone's time for the three tokens it yielded
    assert p.est.probe_time == pytest.approx(spent + 0.3 + verify(3) - 3 * p.verify_cost(1, CONTEXT))
    assert p.est.trials == estimates[3] + 2  # the re-try's tokens are judged as usual


def test_a_draft_models_cost_goes_with_the_tokens_it_evaluates_and_lookups_does_not():
    """A proposal costs what the draft evaluates: its catch-up (the last step's accepted tokens and
    bonus) and a decode per drafted token but the last. Probes' and re-tries' longer catch-ups are
    batches, at another rate per token: they are left out, of the cost and of the usual catch-up."""
    p = AdaptiveLength(k_max=16)
    p.verify_cost.observe(1, CONTEXT, 0.020)
    for _ in range(30):  # 10 ms per evaluated token; a draft of 4 after a fully accepted step: 2 + 3
        p.observe(StepRecord(4, 4, 4, 0.050, 0.028, CONTEXT, draft_evaluated=5))
        p.observe(StepRecord(4, 4, 1, 0.040, 0.028, CONTEXT, draft_evaluated=4))  # after a rejection: 1 + 3
    assert p.learned.catch_up == pytest.approx(1.5, abs=0.05)
    assert p.outlook.draft_times([1, 8], CONTEXT) == pytest.approx([0.015, 0.085], rel=0.05)
    for _ in range(5):  # a probe's window of 17 read as one batch: 4 ms a token, not a decode's 10
        p.observe(StepRecord(2, 2, 0, 0.078, 0.024, CONTEXT, draft_evaluated=18))
    assert p.learned.catch_up == pytest.approx(1.5, abs=0.05)
    assert p.outlook.draft_times([1, 8], CONTEXT) == pytest.approx([0.015, 0.085], rel=0.05)

    lookup = AdaptiveLength(k_max=64, model_draft=False)
    lookup.verify_cost.observe(1, CONTEXT, 0.020)
    for n in (2, 30, 60):
        lookup.observe(StepRecord(n, n, n, 0.0002, 0.020 + 0.002 * n, CONTEXT, draft_evaluated=0))
    assert lookup.outlook.draft_times([1, 64], CONTEXT) == pytest.approx([0.0002, 0.0002], rel=0.05)


def test_the_first_tokens_acceptance_is_learned_apart_after_an_accepted_draft_and_after_a_rejected_one():
    """A step's first draft token is judged against the estimate for steps like the last one (its
    draft wholly accepted: a lookup copy running on; or not: a fresh match), the tokens after it
    against another; E(k) takes the first token's from the state the policy is in."""
    p = AdaptiveLength(k_max=16, prior_acceptance=0.5, prior_weight=4.0, model_draft=False)
    p.outlook.start()
    p.observe(step(4, 0, 0.0, 0.03))  # a fresh match, wrong from its first token
    assert p.est.by_place.estimates[FRESH] == pytest.approx(0.5 - 0.5 / 5) and p.est.by_place.estimates[ALIGNED] == 0.5
    assert p.est.by_place.estimates[LATER] == 0.5  # only the first token was judged
    p.observe(step(4, 4, 0.0, 0.03))  # after a rejection: the first right, then three more
    assert p.est.by_place.estimates[FRESH] == pytest.approx(0.4 + 0.6 / 6)
    assert p.est.by_place.estimates[LATER] == pytest.approx(0.5 + 0.5 / 5 + 0.4 / 6 + (1 - 0.5 - 0.5 / 5 - 0.4 / 6) / 7)
    p.observe(step(4, 4, 0.0, 0.03))  # after a wholly accepted draft
    assert p.est.by_place.estimates[ALIGNED] == pytest.approx(0.5 + 0.5 / 5)
    r = p.est.by_place.estimates[LATER] * p.est.continuation_accepted
    assert p.outlook.expected_tokens(4) == pytest.approx(1 + p.est.by_place.estimates[ALIGNED] * (1 - r ** 4) / (1 - r))
    p.observe(step(4, 1, 0.0, 0.03))  # strays: the next step starts from a fresh match
    r = p.est.by_place.estimates[LATER] * p.est.continuation_accepted
    assert p.outlook.expected_tokens(4) == pytest.approx(1 + p.est.by_place.estimates[FRESH] * (1 - r ** 4) / (1 - r))


def test_the_first_token_estimates_are_kept_between_processes():
    p = AdaptiveLength(prior_acceptance=0.7)
    p.observe(step(4, 4, 0.0, 0.03))
    p.observe(step(4, 2, 0.0, 0.03))
    again = AdaptiveLength()
    again.load_cost_state("acceptance", p.cost_state()["acceptance"])
    assert again.est.by_place.estimates == p.est.by_place.estimates and again.est.by_place.events == p.est.by_place.events
    one_for_all = p.est.state()  # the layout before regimes: one estimate for every request
    with pytest.raises(ValueError):  # dropped (the engine's CostBook then starts from the priors)
        AdaptiveLength().load_cost_state("acceptance", one_for_all)


def test_a_lookups_acceptance_is_learned_by_the_length_of_the_match_each_token_extends():
    """Prompt lookup's layout: a token's estimate is chosen by the match its step's draft extends
    (`Draft.match_length`) plus its place in the step."""
    p = AdaptiveLength(k_max=64, prior_acceptance=0.5, prior_weight=4.0, model_draft=False, runs=(3, 6, 12))
    p.outlook.start()
    assert p.draft_length(64, CONTEXT, offered=10, run=2) > 0 and p.outlook.run == 2
    p.observe(step(6, 2, 0.0, 0.03))  # matches of 2, 3 accepted; 4 rejected
    assert p.est.by_place.events == [1, 2, 0, 0]
    p.draft_length(64, CONTEXT, offered=30, run=10)
    p.observe(step(5, 5, 0.0, 0.03))  # matches of 10..14, all accepted
    assert p.est.by_place.events == [1, 2, 2, 3]
    p.outlook.score_unverified(3, 3, run=2)  # an unused offer, scored where it stood when it was made
    assert p.est.by_place.events == [2, 4, 2, 3]


def test_a_lookups_estimates_are_read_as_growing_with_the_match():
    """A longer match goes on at least as often as a shorter one: estimates learned otherwise (a
    few recent texts' failures on 6-11-token matches) are read pooled with their neighbours, each
    weighted by its events (at most POOL_EVENTS); estimates already in order are read as they are."""
    from localspec.speculative.policy import AcceptanceByPlace

    ordered = AcceptanceByPlace(0.5, LOOKUP_RUNS, LOOKUP_PRIORS)
    assert ordered.monotone() == list(LOOKUP_PRIORS)
    learned = AcceptanceByPlace(0.5, LOOKUP_RUNS, [0.6, 0.75, 0.5, 0.9, 1.0, 1.0])
    learned.events = [10, 31, 100, 5, 5, 5]  # weights 1 + min(events, 32): 11, 32, 33, ...
    read = learned.monotone()
    assert read == sorted(read)
    assert read[0] == 0.6 and read[1] == read[2] == pytest.approx((0.75 * 32 + 0.5 * 33) / 65)
    assert read[3:] == [0.9, 1.0, 1.0]
    assert learned.ahead(3, 6) == [read[2]] * 3  # matches of 6, 7, 8
    assert learned.estimates == [0.6, 0.75, 0.5, 0.9, 1.0, 1.0]  # what is learned and kept is unchanged


def test_a_lookups_estimates_follow_the_text_at_hand():
    """Within a request the lookup's failure probabilities are scaled by how its tokens in this
    text failed against what the estimates predicted for them: a code edit whose matches keep
    failing is drafted less from, a copy that keeps holding more; a new request starts level."""
    p = AdaptiveLength(k_max=64, prior_acceptance=0.5, model_draft=False, runs=LOOKUP_RUNS,
                       place_priors=LOOKUP_PRIORS, text_weight=4.0)
    assert p.outlook.in_this_text([0.52, 0.89]) == [0.52, 0.89]
    p.outlook.start()
    for _ in range(4):  # four fresh matches, each wrong from its first token
        p.draft_length(64, CONTEXT, offered=6, run=2)
        p.observe(step(6, 0, 0.0, 0.03))
    failed = p.outlook.in_this_text([0.52, 0.89])
    assert failed[0] < 0.45 and failed[1] < 0.88  # four failures where ~2 were predicted: ~1.3x as likely
    p.outlook.start()
    assert p.outlook.in_this_text([0.52, 0.89]) == [0.52, 0.89]
    p.draft_length(64, CONTEXT, offered=30, run=2)
    p.observe(step(30, 30, 0.0, 0.05))  # a copy: all held
    held = p.outlook.in_this_text([0.52, 0.89])
    assert 0.52 < held[0] < 1.0 and 0.89 < held[1] < 1.0
    assert AdaptiveLength(k_max=8).outlook.in_this_text([0.3]) == [0.3]  # a draft model's: as learned


def test_a_fresh_match_is_drafted_short_and_a_copy_that_held_long():
    """At the lookup's priors (measured on the bench's prompts), a 2-token match is drafted a few
    tokens long (a 64-token verify pass for 6 right tokens cost 150 ms where 7 tokens cost 40), a
    copy that has held for 48 tokens several times as long."""
    verify = lambda n: 0.020 + 0.002 * (n - 1)  # noqa: E731
    p = AdaptiveLength(k_max=64, model_draft=False, runs=LOOKUP_RUNS, place_priors=LOOKUP_PRIORS,
                       draft_cost_ratio=0.01)
    for _ in range(3):
        for n in (1, 8, 32, 64):
            p.verify_cost.observe(n, CONTEXT, verify(n))
    p.est.fresh_trials = p.min_trials
    fresh = p.draft_length(64, CONTEXT, offered=64, run=2)
    held = p.draft_length(64, CONTEXT, offered=64, run=48)
    assert 2 <= fresh <= 8 and held >= 32


def test_a_lookups_match_estimates_are_kept_and_an_older_layouts_left_out():
    p = AdaptiveLength(model_draft=False, runs=LOOKUP_RUNS, place_priors=LOOKUP_PRIORS)
    p.draft_length(64, CONTEXT, offered=30, run=4)
    p.observe(step(20, 20, 0.0, 0.03))
    again = AdaptiveLength(model_draft=False, runs=LOOKUP_RUNS, place_priors=LOOKUP_PRIORS)
    again.load_cost_state("acceptance", p.cost_state()["acceptance"])
    assert again.est.by_place.estimates == p.est.by_place.estimates and again.est.by_place.events == p.est.by_place.events
    assert again.est.acceptance == p.est.acceptance
    other = AdaptiveLength(model_draft=False, runs=(4, 8), place_priors=(0.6, 0.7, 0.8))  # other match spans
    other.draft_length(64, CONTEXT, offered=30, run=4)
    other.observe(step(4, 1, 0.0, 0.03))
    upgraded = AdaptiveLength(model_draft=False, runs=LOOKUP_RUNS, place_priors=LOOKUP_PRIORS)
    upgraded.load_cost_state("acceptance", other.cost_state()["acceptance"])
    assert upgraded.est.by_place.estimates == list(LOOKUP_PRIORS) and upgraded.est.acceptance == other.est.acceptance
    with pytest.raises(ValueError):
        AdaptiveLength(runs=(4, 1))
    with pytest.raises(ValueError):
        AdaptiveLength(runs=(4, 8), place_priors=(0.5, 0.9))


def test_a_draft_cost_learned_on_a_busy_machine_does_not_keep_the_policy_idle_for_good():
    """A draft priced 3x its cost (fitted while another program ran) makes drafting look worthless;
    an idle policy no longer measures the draft, so a new request re-tries it when the prior guess
    says the pair pays, drafting at the length that guess would choose, on costs it measures afresh:
    drafting resumes."""
    verify = lambda n: 0.022 + 0.003 * (n - 1)  # noqa: E731
    quiet = 0.006  # seconds per evaluated draft token, quiet
    p = primed(verify, 3 * quiet, prior_acceptance=0.93, draft_cost_ratio=0.3)
    for i in range(200):  # the history: drafts of 2..12 tokens, 95% accepted, each 3x dearer than now
        k = 2 + i % 11
        p.observe(step(k, k - (i % 3 == 0), (k + 1) * 3 * quiet, verify(k + 1)))
    for _ in range(64):
        p.observe(step(0, 0, 0.0, verify(1)))
    p.est.fresh_trials = p.min_trials
    assert p.idle and p.draft_length(16, CONTEXT) == 0  # at the busy price, drafting does not pay
    p.outlook.start()
    assert not p.idle  # re-trying
    ks = []
    for i in range(8):  # on a quiet machine
        k = p.draft_length(16, CONTEXT)
        ks.append(k)
        if k:
            p.observe(step(k, k - (i % 3 == 0), (k + 1) * quiet, verify(k + 1), k=k))
    assert ks[0] > p.outlook.probe_length and all(k > 0 for k in ks)
    assert p.draft_cost(5, CONTEXT) == pytest.approx(5 * quiet, rel=0.1) and not p.idle


# --- the hybrid's choice between prompt lookup and the draft model ---------------------------------


def hybrid(verify, draft_cost, *, model_acceptance, lookup_acceptance):
    model = primed(verify, draft_cost, prior_acceptance=model_acceptance)
    lookup = AdaptiveLength(k_max=64, model_draft=False, prior_acceptance=lookup_acceptance, draft_cost_ratio=0.01,
                            runs=LOOKUP_RUNS)
    policy = HybridLength(model, lookup)
    lookup.est.fresh_trials = model.est.fresh_trials = model.min_trials  # judged already: no early probes
    return policy


def planned(p, found=0, limit=64, match_length=0):
    """(source, length) of the plan `p` makes for a step whose lookup found `found` tokens on a match
    `match_length` tokens long, the draft model beside it, `limit` tokens left."""
    plan = p.plan(Offer(lookup=Found(np.arange(1, found + 1, dtype=np.int32), match_length), model=True), limit, CONTEXT)
    return plan.source, plan.length


def offer_scored(record, compared, matched, run):
    """`record` of a step that left the lookup's offer unused, the offer scored as it went."""
    return dataclasses.replace(record, unused=(OfferScore(DraftSource.LOOKUP, compared, matched, run),))


def lookup_step(drafted, accepted, verify_time, context=CONTEXT):
    return StepRecord(drafted, drafted, accepted, 0.0002, verify_time, context, draft_evaluated=0, source="lookup")


def test_the_hybrid_drafts_from_the_lookup_when_it_promises_more_than_the_model_and_from_the_model_otherwise():
    verify = lambda n: 0.020 + 0.002 * (n - 1)  # noqa: E731
    p = hybrid(verify, 0.003, model_acceptance=0.8, lookup_acceptance=0.95)
    assert p.lookup.verify_cost is p.model.verify_cost  # one oracle
    model_k = p.model.outlook.best_length(64, CONTEXT)
    assert 0 < model_k <= 16
    source, k = planned(p, found=20)
    assert source == "lookup" and 1 <= k <= 20  # free tokens, right 95% of the time
    assert planned(p, found=0) == ("model", model_k)  # nothing found: the model's length
    assert planned(p, found=20, limit=6)[1] <= 6  # never past the limit
    assert p.plan(Offer(lookup=Found(np.arange(20, dtype=np.int32))), 64, CONTEXT).source == "lookup"  # no model

    poor = hybrid(verify, 0.003, model_acceptance=0.8, lookup_acceptance=0.2)  # matches that rarely hold
    assert planned(poor, found=20) == ("model", poor.model.outlook.best_length(64, CONTEXT))


def test_a_hybrid_step_teaches_the_policy_of_the_source_that_drafted_it():
    verify = lambda n: 0.020 + 0.002 * (n - 1)  # noqa: E731
    p = hybrid(verify, 0.003, model_acceptance=0.8, lookup_acceptance=0.8)
    model_trials, lookup_acceptance = p.model.est.trials, p.lookup.est.acceptance
    p.observe(lookup_step(10, 10, verify(11)))
    assert p.lookup.est.acceptance > lookup_acceptance and p.model.est.trials == model_trials
    assert p.lookup.est.by_place.events == [3, 3, 4, 0, 0, 0] and p.lookup.outlook.run > 0  # matches of 0..9 tokens, all accepted
    model_acceptance = p.model.est.acceptance
    p.observe(step(4, 0, 0.04, verify(5)))  # the model's draft, rejected: the lookup's next match is fresh
    assert p.model.est.acceptance < model_acceptance and p.lookup.outlook.run == 0
    assert p.lookup.est.trials == 10
    for _ in range(60):  # the lookup's guesses now fail from their first token: it is no longer chosen
        p.observe(lookup_step(8, 0, verify(9)))
    assert planned(p, found=30)[0] == "model"


def test_an_offer_that_was_not_drafted_teaches_the_lookup_what_the_text_is_like_now():
    """Estimates kept from texts that did not repeat left the lookup unchosen on one that does (it
    learned only from its own drafts); its unused offers, scored against the emitted tokens, now
    teach it as drafts would, without touching the costs."""
    verify = lambda n: 0.020 + 0.002 * (n - 1)  # noqa: E731
    p = hybrid(verify, 0.003, model_acceptance=0.9, lookup_acceptance=0.15)
    assert planned(p, found=30)[0] == "model"
    spent, draft_seen = p.lookup.est.time_spent, p.lookup.draft_cost.observations
    sources = []
    for _ in range(12):  # the model drafts; the lookup's offer agrees with all 9 tokens each step emits
        p.observe(offer_scored(step(8, 8, 0.03, verify(9)), 9, 9, run=16))
        sources.append(planned(p, found=30, match_length=16)[0])
    assert sources[0] == "model" and sources[-1] == "lookup"
    assert p.lookup.est.by_place.estimates[3] > 0.8  # matches of 16-23 tokens: these offers' ones
    assert (p.lookup.est.time_spent, p.lookup.draft_cost.observations) == (spent, draft_seen)  # nothing spent
    p.lookup.outlook.score_unverified(0, 3)  # an offer wrong from its first token: the next one is fresh
    assert p.lookup.outlook.run == 0


def test_a_request_whose_lookup_always_finds_something_still_lets_the_model_probe_and_re_try():
    """An idle draft model's probes and re-tries used to lose to the lookup's offers whenever it had
    one: on a text that repeats itself the request kept to the lookup for its whole answer, the
    model never tried again (its estimates never learned the text had become easy for it). Now a
    draft made for evidence goes first; the lookup's offer of that step is still scored."""
    verify = lambda n: 0.020 + 0.002 * (n - 1)  # noqa: E731
    p = hybrid(verify, 0.010, model_acceptance=0.9, lookup_acceptance=0.9)
    p.model.probe_every, p.model.outlook.probe_budget = 5, 0.05
    for _ in range(40):  # the model's drafts all rejected: idle
        p.model.observe(step(4, 0, 0.05, verify(5)))
    assert p.model.idle
    sources = []
    for _ in range(30):  # the lookup finds a long match at every step, and its drafts hold
        source, k = planned(p, found=12, match_length=8)
        sources.append(source)
        if source == "lookup":
            p.observe(lookup_step(k, k, verify(k + 1)))
        else:  # the model's probe, all of it accepted: the text is easy for it now
            p.observe(offer_scored(step(k, k, 0.02, verify(k + 1), k=k), k + 1, k + 1, run=8))
    assert sources.count("model") >= 1 and sources[0] == "lookup"
    assert p.model.outlook.retry_wanted or p.model.est.exploring or p.model.est.fresh_trials < p.model.min_trials
    # the re-try the probe asked for drafts from the model too, its first trials judged on this text
    assert planned(p, found=12, match_length=8)[0] == "model"

    judged = hybrid(verify, 0.010, model_acceptance=0.9, lookup_acceptance=0.9)  # nothing to find out
    assert planned(judged, found=12, match_length=8)[0] == "lookup"


def test_the_hybrids_lookup_estimates_are_kept_beside_the_models():
    verify = lambda n: 0.020 + 0.002 * (n - 1)  # noqa: E731
    p = hybrid(verify, 0.003, model_acceptance=0.8, lookup_acceptance=0.8)
    p.observe(lookup_step(6, 2, verify(7)))
    p.observe(step(4, 4, 0.04, verify(5)))
    state = p.cost_state()
    assert set(state) == {"verify", "draft", "acceptance", "lookup_acceptance"}
    again = HybridLength(AdaptiveLength(), AdaptiveLength(k_max=64, model_draft=False))
    for kind, s in state.items():
        again.load_cost_state(kind, s)
    assert again.lookup.est.acceptance == pytest.approx(p.lookup.est.acceptance)
    assert again.model.est.acceptance == pytest.approx(p.model.est.acceptance)
    assert again.model.verify_cost(5, CONTEXT) == pytest.approx(p.model.verify_cost(5, CONTEXT))


# ---------------------------------------------------------------- sampling regimes


def test_a_requests_regime_is_greedy_or_its_temperature_band_with_filters_and_grammar_apart():
    from localspec.speculative.sampling import SamplingParams

    assert Regime.of(SamplingParams()) == GREEDY and GREEDY.describe() == "greedy"
    assert Regime.of(SamplingParams(top_p=0.5)) == GREEDY  # greedy ignores the filters
    assert Regime.of(SamplingParams(temperature=0.0, seed=3)) == GREEDY
    bands = [Regime.of(SamplingParams(temperature=t)).band for t in (0.1, 0.25, 0.3, 0.7, 0.8, 1.0, 1.15, 1.5)]
    assert bands == [1, 1, 2, 3, 3, 4, 4, 5]
    assert Regime.of(SamplingParams(temperature=1.0)).describe() == "temperature 0.85-1.15"
    assert Regime.of(SamplingParams(temperature=2.0)).describe() == "temperature > 1.15"
    for filtered in (SamplingParams(temperature=1.0, top_k=40), SamplingParams(temperature=1.0, top_p=0.9),
                     SamplingParams(temperature=1.0, min_p=0.05)):
        assert Regime.of(filtered).filtered and Regime.of(filtered) != Regime.of(SamplingParams(temperature=1.0))
    assert Regime.of(SamplingParams(temperature=1.0, seed=1)) == Regime.of(SamplingParams(temperature=1.0))
    assert Regime.of(SamplingParams(), constrained=True).describe() == "greedy, grammar"
    assert Regime.from_state(Regime(3, True, True).state()) == Regime(3, True, True)
    with pytest.raises(ValueError):
        Regime.from_state({"band": 9, "filtered": False, "constrained": False})


SAMPLED = Regime(4)  # temperature 1


def test_a_regime_where_drafting_does_not_pay_leaves_another_drafting():
    """Sampled requests whose drafts are mostly rejected idle drafting for sampled requests only:
    a greedy request after them is priced with what greedy requests taught (one estimate for all
    had 40 short sampled requests switch drafting off for the greedy ones after them)."""
    verify = lambda n: 0.024 + 0.002 * n  # noqa: E731
    p = primed(verify, draft_cost=0.004)
    p.outlook.start(GREEDY)
    for _ in range(30):
        p.observe(step(6, 6, 0.028, verify(7)))
    greedy_k = p.draft_length(16, CONTEXT)
    assert greedy_k >= 6
    for _ in range(40):  # 40 sampled requests, their drafts mostly rejected
        p.outlook.start(SAMPLED)
        for _ in range(4):
            k = p.draft_length(16, CONTEXT)
            p.observe(step(k, 0, 0.004 * (k + 1), verify(k + 1)) if k else step(0, 0, 0.0, verify(1)))
    assert p.idle and p.est.acceptance < 0.5
    p.outlook.start(GREEDY)
    assert not p.idle and p.est.acceptance > 0.95
    assert p.draft_length(16, CONTEXT) == greedy_k
    p.outlook.start(Regime(1))  # a regime never met: its priors, drafting at once
    assert not p.idle and p.est.trials == 0 and p.draft_length(16, CONTEXT) > 0


def test_each_regimes_estimates_and_probe_account_are_kept_between_processes():
    verify = lambda n: 0.024 + 0.002 * n  # noqa: E731
    p = primed(verify, draft_cost=0.004)
    p.outlook.start(GREEDY)
    p.observe(step(4, 4, 0.02, verify(5)))
    p.outlook.start(SAMPLED)
    for _ in range(20):
        p.observe(step(4, 0, 0.02, verify(5)))
    state = p.cost_state()["acceptance"]
    assert state["layout"] == ACCEPTANCE_LAYOUT and len(state["regimes"]) == 2
    again = primed(verify, draft_cost=0.004)
    again.load_cost_state("acceptance", state)
    for regime in (GREEDY, SAMPLED):
        again.outlook.start(regime)
        p.outlook.start(regime)
        assert again.est.state() == p.est.state()
    assert again.learned.estimates[GREEDY].acceptance > 0.9 > 0.3 > again.learned.estimates[SAMPLED].acceptance
    assert again.learned.estimates[SAMPLED].time_spent > again.learned.estimates[GREEDY].time_spent > 0


def test_each_regime_probes_within_its_own_budget():
    """An idle regime's probes spend its own budget, not a drafting one's: hours of greedy drafting
    do not buy an idle sampled regime a burst of probes, and its probes leave greedy's budget whole."""
    verify = lambda n: 0.024 + 0.002 * n  # noqa: E731
    p = idle_pair(verify, probe_budget=0.02)
    p.outlook.start(GREEDY)
    greedy_account = (p.est.time_spent, p.est.probe_time)
    p.outlook.start(SAMPLED)
    for _ in range(40):
        p.observe(step(4, 0, 0.04, verify(5)))
    assert p.idle
    sampled_probes = run_idle(p, verify, 1000)  # ~26 s of sampled requests
    assert 2 <= len(sampled_probes) <= 4  # ~2% of 26 s, 0.2 s each
    p.outlook.start(GREEDY)
    assert (p.est.time_spent, p.est.probe_time) == greedy_account


def test_a_retry_that_pays_costs_the_probe_budget_nothing():
    """Exploring is charged what it cost beyond the oracle alone's time for the tokens it yielded:
    a re-try whose drafts were accepted leaves the budget for the next one, so a regime that an
    unlucky stretch idled is re-tried at the next request, not after minutes of budget."""
    verify = lambda n: 0.024 + 0.002 * n  # noqa: E731
    p = primed(verify, draft_cost=0.004, prior_acceptance=0.95, probe_budget=0.0001)  # ~2 ms of budget
    for _ in range(300):
        p.observe(step(6, 6, 0.028, verify(7)))
    for _ in range(3):  # three requests in a row, each idled by an unlucky stretch and re-trying at the next
        while not p.idle:
            p.observe(step(4, 0, 0.02, verify(5)))
        p.outlook.start(GREEDY)
        assert not p.idle and p.draft_length(16, CONTEXT) > 0
        spent = p.est.probe_time
        while p.est.exploring:
            k = p.draft_length(16, CONTEXT)
            p.observe(step(k, k, 0.004 * (k + 1), verify(k + 1)))
        assert p.est.probe_time == spent  # each step yielded more than its cost's worth of oracle passes


def test_an_idle_policy_says_why_in_numbers():
    verify = lambda n: 0.024 + 0.002 * n  # noqa: E731
    p = idle_pair(verify)
    p.outlook.start(SAMPLED)
    for _ in range(40):
        p.observe(step(4, 0, 0.04, verify(5)))
    why = p.explain("the draft model")
    assert why.startswith("the draft model's estimated acceptance ") and "(temperature 0.85-1.15; an oracle pass 26 ms" in why
    assert re.search(r"a draft token \d+ ms\) predicts 0\.\d\dx the oracle alone at best \(k=\d+\); drafting needs 1\.10x$", why)
    assert FixedLength(0).explain() == "a fixed draft length of 0" and FixedLength(4).explain() is None


def test_re_tries_that_keep_failing_back_off():
    """An idle regime whose long-run acceptance says drafting pays re-tries at a request's start
    even with its probe budget spent (a stall may have idled it); a re-try that finds it does not
    pay doubles the wait before the next: over 40 requests, 5 re-tries, not 40."""
    verify = lambda n: 0.024 + 0.002 * n  # noqa: E731
    p = primed(verify, draft_cost=0.030, prior_acceptance=0.95, draft_cost_ratio=0.05, probe_budget=0.0)
    for _ in range(300):  # drafts that were accepted, at a draft cost that makes them not pay
        p.observe(step(4, 4, 0.15, verify(5)))
    assert p.idle and p.est.long_acceptance > 0.9
    retries = []
    for request in range(40):
        p.outlook.start(GREEDY)
        if p.est.exploring:
            retries.append(request)
            while p.est.exploring:
                k = p.draft_length(16, CONTEXT)
                p.observe(step(k, k, 0.030 * (k + 1), verify(k + 1)))
        for _ in range(20):
            p.observe(step(0, 0, 0.0, verify(1)))
    assert retries == [0, 2, 6, 14, 30]
    assert p.est.retry_wait == 32 and p.cost_state()["acceptance"]["regimes"][0]["retry_wait"] == 32


# ---------------------------------------------------------------- a pass shared by several sequences


def batch_primed(k_max=16, **kw):
    """A policy whose costs are the default pair's on a 2-core EPYC: an oracle pass of N tokens of S
    sequences 17 + 4 [N>1] + 3.4 N + 1 (S - 1) ms (memory-bound: llama.cpp's batched decoding), a
    draft round of m sequences' tokens 4 + 6 m ms (a small Q4_1 model: each token costs)."""
    p = AdaptiveLength(k_max=k_max, prior_acceptance=0.95, **kw)
    p.learned.catch_up = 1.5
    for _ in range(3):
        for ns in ([1], [2], [5], [9], [17], [1, 1], [1] * 4, [1] * 8, [3] * 4, [5] * 8):
            p.observe_pass([(ns, [CONTEXT] * len(ns))], (17 + 4 * (sum(ns) > 1) + 3.4 * sum(ns) + (len(ns) - 1)) / 1000)
        for m in (1, 2, 4, 8):
            p.observe_draft_round([([1] * m, [CONTEXT] * m)], (4 + 6 * m) / 1000)
        for n in (1, 2, 4, 8, 16):
            p.draft_cost.observe(n + 1, CONTEXT, (n + 1) * 0.010)
    p.est.fresh_trials = p.est.trials = 50
    p.outlook.context = CONTEXT
    return p


def test_drafting_shrinks_and_stops_as_the_batch_fills_and_comes_back_when_it_thins():
    """Alone, a 95% draft pays; beside other sequences the pass is what plain batched decoding makes
    cheaply, and each draft token costs the draft model's decode: fewer draft tokens at 2, none at 4
    and 8; alone again, the same as before."""
    p = batch_primed()
    lengths = {}
    for s in (1, 2, 4, 8, 1):
        p.outlook.price = p.learned.batch_price([CONTEXT] * s, CONTEXT, drafting=s) if s > 1 else None
        lengths.setdefault(s, []).append(p.outlook.best_length(16))
    assert lengths[1][0] >= 4 and lengths[1][0] == lengths[1][1]
    assert lengths[2][0] < lengths[1][0]
    assert lengths[4] == [0] and lengths[8] == [0]


def test_a_free_lookup_draft_stays_worth_it_in_a_full_batch():
    """Prompt lookup costs no decode: a copy that has held long is drafted in a batch of eight too."""
    lookup = AdaptiveLength(k_max=64, model_draft=False, runs=LOOKUP_RUNS, place_priors=LOOKUP_PRIORS)
    model = batch_primed()
    lookup.verify_cost = model.verify_cost
    lookup.est.fresh_trials = lookup.est.trials = 50
    lookup.outlook.price = model.learned.batch_price([CONTEXT] * 8, CONTEXT, drafting=2)
    assert lookup.draft_length(64, CONTEXT, offered=40, run=30) >= 8
    assert lookup.draft_length(64, CONTEXT, offered=40, run=1) <= 4  # a 2-token coincidence: short or nothing


def test_a_catch_up_after_prompt_lookups_tokens_is_not_taken_for_the_drafts_own():
    """After the draft model's own steps it catches up on one or two tokens; after a stretch of
    prompt lookup on three or four: that proposal is a sample of the draft's cost, not of its
    catch-up, which would otherwise price every later draft of the model a token dearer."""
    p = primed(lambda n: 0.02 + 0.003 * n, draft_cost=0.005)
    p.learned.catch_up = 1.5
    for caught_up in (4, 3, 4, 3, 4, 3):
        p.observe(StepRecord(k=4, drafted=4, accepted=2, draft_time=(caught_up + 3) * 0.005, verify_time=0.035,
                            context=CONTEXT, draft_evaluated=caught_up + 3, source="model"))
    assert p.learned.catch_up == pytest.approx(1.5)
    for caught_up in (1, 2) * 20:
        p.observe(StepRecord(k=4, drafted=4, accepted=2, draft_time=(caught_up + 3) * 0.005, verify_time=0.035,
                            context=CONTEXT, draft_evaluated=caught_up + 3, source="model"))
    assert p.learned.catch_up == pytest.approx(1.5, abs=0.05)


def test_an_idle_step_where_no_acceptance_would_pay_rests_between_rechecks():
    """A draft as dear as its oracle's one-token pass: the policy drafts nothing, and between its
    rechecks (every recheck_every steps) an idle step computes no rates at all, probes none: its
    host time is the oracle alone's."""
    verify = lambda n: 0.00125 if n == 1 else 0.0026 + 0.0001 * n  # noqa: E731 (an H200's shape)
    p = primed(verify, 0.0016)
    calls = []
    real = p.outlook.rates
    p.outlook.rates = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    ks = []
    for _ in range(64):
        ks.append(p.draft_length(16, CONTEXT))
        p.observe(step(0, 0, 0.0, verify(1)))
    assert ks == [0] * 64
    assert len(calls) <= 3 * (64 // p.recheck_every), len(calls)  # a recheck's, a probe's; 2 a step before


def test_where_no_acceptance_would_pay_the_rechecks_grow_apart_and_drafting_resumes_when_it_pays():
    """Idle where no acceptance would pay (a draft as dear as its oracle), a draft model's policy
    rechecks every 8 idle steps, and after 8 such rechecks 16, 32 and then 64 steps apart (only the
    oracle's cost moves meanwhile, with the context), and makes no probe: 512 idle steps cost a few
    dozen rate computations, not one every 8th step. Once the oracle's passes grow dear enough that
    drafting pays (a long context, say), it drafts again within the longest rest."""
    verify = lambda n: 0.00125 if n == 1 else 0.0026 + 0.0001 * n  # noqa: E731 (an H200's shape)
    p = primed(verify, 0.0016)
    calls = []
    real = p.outlook.rates
    p.outlook.rates = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    for _ in range(512):
        assert p.draft_length(16, CONTEXT) == 0
        p.observe(step(0, 0, 0.0, verify(1)))
    assert len(calls) <= 3 * 18, len(calls)  # rechecks every 8 to 64, at 80, 112, then every 64 (and probes')
    assert p.est.rechecks >= p.recheck_patience + 3
    dear = lambda n: 0.030 + 0.0001 * n  # noqa: E731 (a big oracle: a pass costs nearly the same for 1 or 17 tokens)
    for n in (1, 2, 4, 8, 16) * 30:
        p.verify_cost.observe(n, CONTEXT, dear(n))
    waited = next(i for i in range(200) if p.draft_length(16, CONTEXT) > 0 or p.observe(step(0, 0, 0.0, dear(1))))
    assert waited <= p.recheck_max
    assert p.est.rechecks == 0
