"""Drafting against plain batched decoding, as measured (localspec.runtime.batch_judge): pure."""

from __future__ import annotations

from localspec.runtime.batch_judge import MIN_DRAFTING, RECHECK_EVERY, SEEN_DRAFTING, BatchJudge


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


def test_drafting_measured_slower_than_plain_turns_off_with_rechecks():
    judge = BatchJudge()
    measured(judge, 4, plain_rate=20.0, drafting_rate=14.0, drafting=MIN_DRAFTING - 1)
    assert not judge.plain(4)  # too few drafting steps for a verdict
    judge.observe(4, True, 12, 12 / 14.0)
    assert judge.drafting_loses(4) and judge.plain(4)
    for _ in range(RECHECK_EVERY - 1):
        judge.observe(4, False, 4, 0.2)
        assert judge.plain(4)
    judge.observe(4, False, 4, 0.2)
    assert not judge.plain(4)  # a re-check: the policies may draft once
    judge.observe(4, True, 12, 12 / 14.0)
    assert judge.plain(4)  # still slower: plain again


def test_drafting_that_pays_or_ties_is_left_alone():
    judge = BatchJudge()
    measured(judge, 8, plain_rate=20.0, drafting_rate=30.0, drafting=3 * MIN_DRAFTING)
    assert not judge.drafting_loses(8) and not judge.plain(8)
    judge = BatchJudge()
    measured(judge, 8, plain_rate=20.0, drafting_rate=19.0, drafting=3 * MIN_DRAFTING)  # within the margin: noise
    assert not judge.plain(8)


def test_the_rates_follow_a_change():
    """Drafting that lost becomes worth it again (acceptance rose with the text): the re-checks see it."""
    judge = BatchJudge()
    measured(judge, 4, plain_rate=20.0, drafting_rate=14.0, drafting=MIN_DRAFTING)
    assert judge.plain(4)
    for _ in range(40):
        for _ in range(RECHECK_EVERY):
            judge.observe(4, False, 4, 0.2)
        if not judge.plain(4):
            judge.observe(4, True, 12, 12 / 40.0)
    assert not judge.drafting_loses(4)
    plain, drafting = judge.describe()[4]
    assert abs(plain - 20.0) < 1e-6 and drafting > plain
