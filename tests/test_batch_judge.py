"""Drafting against plain batched decoding, as measured (localspec.runtime.batch_judge): pure."""

from __future__ import annotations

from localspec.runtime.batch_judge import (MIN_DRAFTING, RECHECK_EVERY, RECHECK_MAX, REFRESH_EVERY, SEEN_DRAFTING,
                                           BatchJudge)


def measured(judge: BatchJudge, sequences: int, *, plain_rate: float, drafting_rate: float, drafting: int) -> None:
    """`drafting` drafting steps, then one plain step, at the given tokens per second."""
    for _ in range(drafting):
        tokens = 3 * sequences
        judge.observe(sequences, True, tokens, tokens / drafting_rate)
    judge.observe(sequences, False, sequences, sequences / plain_rate)


def test_a_single_stream_is_never_judged():
    judge = BatchJudge()
    assert not judge.plain(1)
    judge.observe(1, True, 1, 10.0)  # nothing is kept of it
    assert judge.describe() == {}


def test_plain_batching_is_measured_once_where_drafting_may_be_slower_than_it():
    """A one-token pass of 0.2 s: four one-token rows make at most 20 tokens/s plain."""
    judge = BatchJudge()
    one_token_pass = lambda: 0.2  # noqa: E731
    for _ in range(SEEN_DRAFTING):
        assert not judge.plain(4, one_token_pass)  # the policies' drafts first
        judge.observe(4, True, 12, 12 / 14.0)
    assert judge.plain(4, one_token_pass)  # 14 tokens/s drafting, under the 20 plain might make
    assert judge.plain(4)  # ... and where the pass cost is not known yet
    judge.observe(4, False, 4, 0.2)
    assert not judge.plain(4, one_token_pass)  # measured; too few drafting steps for a verdict yet
    fast = BatchJudge()
    for _ in range(3 * SEEN_DRAFTING):
        fast.observe(8, True, 40, 40 / 120.0)  # 120 tokens/s: more than plain batching's 40 at best
        assert not fast.plain(8, one_token_pass) and not fast.plain(2, one_token_pass)  # sizes apart


def test_drafting_measured_slower_than_plain_turns_off_with_rechecks_that_back_off():
    judge = BatchJudge()
    measured(judge, 4, plain_rate=20.0, drafting_rate=14.0, drafting=MIN_DRAFTING - 1)
    assert not judge.plain(4)  # too few drafting steps for a verdict
    judge.observe(4, True, 12, 12 / 14.0)
    assert judge.drafting_loses(4) and judge.plain(4)
    interval = RECHECK_EVERY
    for _ in range(3):
        for _ in range(interval - 1):
            judge.observe(4, False, 4, 0.2)
            assert judge.plain(4)
        judge.observe(4, False, 4, 0.2)
        assert not judge.plain(4)  # a re-check: the policies may draft once
        judge.observe(4, True, 12, 12 / 14.0)
        assert judge.plain(4)  # still slower: plain again, and the next re-check waits twice as long
        interval *= 2
    for _ in range(10):  # ... up to RECHECK_MAX
        for _ in range(RECHECK_MAX):
            judge.observe(4, False, 4, 0.2)
        assert not judge.plain(4)
        judge.observe(4, True, 12, 12 / 14.0)


def test_drafting_that_pays_is_left_alone_and_a_tie_goes_to_plain():
    judge = BatchJudge()
    measured(judge, 8, plain_rate=20.0, drafting_rate=30.0, drafting=3 * MIN_DRAFTING)
    assert not judge.drafting_loses(8) and not judge.plain(8)
    judge = BatchJudge()
    measured(judge, 8, plain_rate=20.0, drafting_rate=20.5, drafting=3 * MIN_DRAFTING)  # level: drafting's other costs decide
    assert judge.drafting_loses(8) and judge.plain(8)
    judge = BatchJudge()
    measured(judge, 8, plain_rate=20.0, drafting_rate=21.5, drafting=3 * MIN_DRAFTING)  # more than WIN faster
    assert not judge.drafting_loses(8) and not judge.plain(8)


def test_plain_is_measured_again_where_drafting_wins_within_its_reach():
    """Drafting 8% faster than a plain rate measured once: one plain step every REFRESH_EVERY drafting
    steps keeps that rate current; here plain has become faster (the first measure was a slow moment)."""
    one_token_pass = lambda: 0.2  # noqa: E731  (plain batching's best: 40 tokens/s at 8)
    judge = BatchJudge()
    measured(judge, 8, plain_rate=20.0, drafting_rate=21.6, drafting=MIN_DRAFTING)
    plains = []
    for step in range(3 * REFRESH_EVERY):
        if judge.plain(8, one_token_pass):
            plains.append(step)
            judge.observe(8, False, 8, 8 / 30.0)  # plain now measures 30 tokens/s
        else:
            judge.observe(8, True, 24, 24 / 21.6)
    assert plains[0] == REFRESH_EVERY  # the refresh, after REFRESH_EVERY drafting steps
    drafted = [step for step in range(REFRESH_EVERY, 3 * REFRESH_EVERY) if step not in plains]
    assert judge.drafting_loses(8) and drafted == [REFRESH_EVERY + RECHECK_EVERY]  # plain from the refresh on, but for a re-check


def test_drafting_beyond_plain_batchings_reach_is_never_interrupted():
    """A GPU with a dear oracle: drafting at 3x plain batching's best is never stopped to measure
    plain, and the bound is asked once every REFRESH_EVERY drafting steps, not at every step."""
    asked = []
    one_token_pass = lambda: asked.append(1) or 0.2  # noqa: E731  (plain: 40 tokens/s at best)
    judge = BatchJudge()
    for _ in range(4 * REFRESH_EVERY + SEEN_DRAFTING):
        assert not judge.plain(8, one_token_pass)
        judge.observe(8, True, 48, 48 / 120.0)
    assert len(asked) == 4 and 8 not in {s for s, (p, _) in judge.describe().items() if p}


def test_the_rates_follow_a_change():
    """Drafting that lost becomes worth it again (acceptance rose with the text): the re-checks see it."""
    judge = BatchJudge()
    measured(judge, 4, plain_rate=20.0, drafting_rate=14.0, drafting=MIN_DRAFTING)
    assert judge.plain(4)
    plain_steps = 0
    while judge.plain(4):
        judge.observe(4, False, 4, 0.2)
        plain_steps += 1
        if not judge.plain(4):
            judge.observe(4, True, 12, 12 / 40.0)
    assert not judge.drafting_loses(4) and plain_steps < 8 * RECHECK_MAX
    plain, drafting = judge.describe()[4]
    assert abs(plain - 20.0) < 1e-6 and drafting > plain


def test_it_says_why_steps_ran_plain():
    judge = BatchJudge()
    measured(judge, 4, plain_rate=20.0, drafting_rate=14.0, drafting=MIN_DRAFTING)
    assert judge.explain(4) == "plain batched decoding of 4 sequences measured 20.0 tokens/s, drafting 14.0"
    fresh = BatchJudge()
    for _ in range(SEEN_DRAFTING):
        fresh.observe(2, True, 6, 6 / 7.5)
    assert fresh.explain(2) == "plain batched decoding of 2 sequences measured against drafting (7.5 tokens/s)"


def test_what_it_measured_is_kept_between_processes():
    """A restarted server starts from the kept rates: where drafting lost at four sequences, its
    first step of four measures plain again and the next ones run plain; a malformed state raises
    and changes nothing."""
    import json

    import pytest

    judge = BatchJudge()
    measured(judge, 4, plain_rate=20.0, drafting_rate=14.0, drafting=MIN_DRAFTING)
    state = json.loads(json.dumps(judge.state()))  # as the cost cache keeps it
    again = BatchJudge()
    again.load_state(state)
    assert again.describe() == judge.describe() and again.drafting_loses(4)
    assert again.plain(4, lambda: 0.2)  # plain measured at once (due), then plain as the kept verdict says
    again.observe(4, False, 4, 0.2)
    assert again.plain(4, lambda: 0.2)
    assert BatchJudge().state() == {}  # nothing measured: nothing kept
    broken = BatchJudge()
    for bad in ({"sizes": {"4": {"plain": [4.0, 0.0, 1]}}}, {"sizes": {"x": {}}}, {}):
        with pytest.raises((ValueError, TypeError, KeyError)):
            broken.load_state(bad)
    assert broken.describe() == {}
