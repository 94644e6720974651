"""The suffix cache (speculative/suffix.py): what the store offers from earlier requests' text, its
bounds, its pools, and the engine drafting from it without changing a token of the output."""

from __future__ import annotations

import json
from contextlib import nullcontext

import numpy as np
import pytest

from localspec.options import GenerationOptions
from localspec.outputs import DraftSource, StepRecord
from localspec.runtime.engine import Engine
from localspec.speculative.plan import DraftPlan, Found, Offer, plain_plan
from localspec.speculative.policy import FixedLength
from localspec.speculative.lookup import PromptLookupProposer
from localspec.speculative.proposers import DraftModelProposer, drive
from localspec.speculative.sampling import SamplingParams
from localspec.speculative.suffix import CANDIDATES, LONG, NGRAM, SuffixPools, SuffixProposer, SuffixStore
from scripted import EOS, ScriptedContext, ScriptedModel, hashed_logits, related_logits

GREEDY = SamplingParams()


def offered(store: SuffixStore, history, limit: int = 16) -> tuple[list[int], int]:
    tokens, matched = store.offer(history, limit)
    return tokens.tolist(), matched


def test_an_earlier_documents_continuation_is_offered_with_its_match():
    store = SuffixStore(1000)
    store.add([1, 2, 3, 4, 5, 6, 7, 8])
    assert offered(store, [9, 2, 3, 4]) == ([5, 6, 7, 8], 3)  # "2 3 4" matched; what followed, to the document's end
    assert offered(store, [1, 2, 3, 4], limit=2) == ([5, 6], 4)
    assert offered(store, [9, 9, 3, 4]) == ([], 0)  # "3 4" alone is shorter than an n-gram
    assert offered(store, [6, 7, 8]) == ([], 0)  # nothing followed the end of a document
    assert offered(SuffixStore(1000), [1, 2, 3]) == ([], 0)


def test_the_longest_match_wins_and_the_latest_on_a_tie():
    store = SuffixStore(1000)
    store.add([7, 1, 2, 3, 10, 11])
    store.add([8, 1, 2, 3, 20, 21])
    assert offered(store, [7, 1, 2, 3]) == ([10, 11], 4)  # the older one agrees further back
    assert offered(store, [9, 1, 2, 3]) == ([20, 21], 3)  # as long: the latest


def test_a_continuation_is_cut_where_the_candidates_stop_agreeing():
    store = SuffixStore(1000)
    for tail in ([5, 6, 7, 8], [5, 6, 9, 9], [5, 6, 9, 8]):
        store.add([1, 2, 3, 4] + tail)
    # the latest says 5 6 9 8; after "5 6" two of three agree on 9, after "5 6 9" only it says 8
    assert offered(store, [0, 2, 3, 4]) == ([5, 6, 9], 3)
    store.add([1, 2, 3, 4, 5, 6, 9, 8])
    assert offered(store, [0, 2, 3, 4]) == ([5, 6, 9, 8], 3)  # two of four now: not fewer than half


def test_a_long_match_is_not_cut_by_candidates_that_agree_only_briefly():
    """A request sent again matches its own earlier text far back; other answers in the same format
    match only the last few tokens and go on differently: they do not cut the repeat short."""
    store = SuffixStore(10_000)
    store.add(list(range(100, 140)) + [1, 2, 3, 50, 51, 52, 53])  # the request and its answer
    for i in range(6):  # other requests, their answers in the same format: "1 2 3" then their own values
        store.add(list(range(200 + 40 * i, 240 + 40 * i)) + [1, 2, 3, 60 + i, 70 + i])
    assert offered(store, list(range(100, 140)) + [1, 2, 3]) == ([50, 51, 52, 53], 43)
    assert offered(store, [9, 9, 1, 2, 3]) == ([], 3)  # a brief match: seven candidates disagree at once


def test_a_repeat_is_found_behind_more_recent_documents_that_share_only_its_last_tokens():
    """The records workload sent again: the request's earlier answer lies behind many later ones
    that end their prompts the same way (a chat template's turn marker, a format's first field);
    the short n-gram's latest occurrences are all theirs, the long n-gram's is the repeat's."""
    store = SuffixStore(10_000)
    turn = [1, 2, 3, 4, 5]  # the template's end of prompt, then the format's first tokens
    store.add(list(range(100, 140)) + turn + [50, 51, 52, 53])  # the request and its answer
    for i in range(3 * CANDIDATES):
        store.add(list(range(1000 + 40 * i, 1040 + 40 * i)) + turn + [60 + i, 70 + i])
    assert offered(store, list(range(100, 140)) + turn) == ([50, 51, 52, 53], 45)
    # text that shares fewer than LONG tokens with it: the short n-gram's candidates, as before
    short = [9] * 30 + list(range(140 - (LONG - len(turn)) + 1, 140)) + turn
    assert offered(store, short)[0] != [50, 51, 52, 53]


def test_the_store_keeps_at_most_its_capacity_the_oldest_going_first():
    store = SuffixStore(20)
    nbytes = store.nbytes
    store.add([1, 2, 3, 4, 5, 6, 7, 8, 9])
    store.add([11, 12, 13, 14, 15, 16, 17, 18, 19])
    assert offered(store, [1, 2, 3]) == ([4, 5, 6, 7, 8, 9], 3)
    store.add([21, 22, 23, 24, 25, 26, 27, 28, 29])  # 30 tokens written: the first document is overwritten
    assert offered(store, [1, 2, 3]) == ([], 0) and offered(store, [21, 22, 23]) == ([24, 25, 26, 27, 28, 29], 3)
    assert offered(store, [12, 13, 14]) == ([15, 16, 17, 18, 19], 3)
    assert store.tokens == 20 and store.nbytes == nbytes  # bounded: nothing grows
    store.add(list(range(100, 200)))  # longer than the store: its end is kept
    assert offered(store, [195, 196, 197]) == ([198, 199], 3) and offered(store, [21, 22, 23]) == ([], 0)


def test_hash_collisions_are_not_taken_for_matches():
    store = SuffixStore(1 << 12)
    rng = np.random.default_rng(0)
    for _ in range(40):
        store.add(rng.integers(0, 1 << 20, 100).tolist())
    for _ in range(200):  # random text: any offer must follow a real earlier occurrence
        history = rng.integers(0, 1 << 20, 8).tolist()
        tokens, matched = store.offer(history, 8)
        assert not len(tokens) and matched == 0


def test_each_pool_drafts_only_from_its_own_requests():
    pools = SuffixPools(1000)
    pools.add("alice", [[1, 2, 3, 4, 5]])
    assert offered(pools.store("alice"), [1, 2, 3]) == ([4, 5], 3)
    assert pools.store("bob") is None and pools.store("") is None  # nothing kept for them: no store made
    assert pools.stats()["pools"] == 1 and pools.stats()["documents"] == 1
    assert SuffixPools(0).store("alice") is None  # 0: no cache


def test_the_proposer_adds_the_caches_offer_to_the_inner_ones_and_drafts_the_plan():
    pools = SuffixPools(1000)
    pools.add("", [[1, 2, 3, 4, 5, 6, 50]])
    proposer = SuffixProposer(PromptLookupProposer(), pools, is_end=lambda t: t == 50)
    proposer.start(catch_up=True)
    history = [9, 2, 3, 4, 8, 9, 2, 3]  # with a 4 next: prompt lookup finds "9 2 3 4" earlier, the cache "2 3 4"
    offer = proposer.offer(history + [4], 8)
    assert offer.lookup.tokens.tolist() == [8, 9, 2, 3, 4] and offer.suffix.tokens.tolist() == [5, 6, 50]
    assert offer.suffix.match_length == 3  # cut after the end of generation, which it may still draft
    assert plain_plan(offer, 8) == DraftPlan(DraftSource.LOOKUP, 5)  # without a learning policy: lookup first
    draft = drive(proposer.propose_steps(history + [4], DraftPlan(DraftSource.SUFFIX, 2), offer, GREEDY, None), None)
    assert draft.tokens.tolist() == [5, 6] and draft.source == DraftSource.SUFFIX
    assert plain_plan(Offer(suffix=Found(np.array([5], dtype=np.int32))), 8) == DraftPlan(DraftSource.SUFFIX, 1)


def without_end(logits):
    """`logits` with the end of generation never likely: answers run to max_tokens."""
    def at(history):
        row = logits(history).copy()
        row[EOS] = -30.0
        return row

    return at


def suffix_engine(pools: SuffixPools) -> tuple[Engine, Engine]:
    """A deterministic oracle with a draft model of its vocabulary that rarely agrees with it, the
    suffix cache beside it (FixedLength: the cache's tokens where it found some, else the model's);
    and the oracle alone, to compare with."""
    model = ScriptedModel.sized(40, "oracle")
    logits = without_end(hashed_logits(3, 40))
    draft = ScriptedContext(ScriptedModel.sized(40, "draft"), related_logits(logits, 40, 9, 40, weight=0.05))
    proposer = SuffixProposer(DraftModelProposer(draft, n_vocab=40), pools, is_end=model.is_eog)
    engine = Engine.from_parts(oracle=ScriptedContext(model, logits), proposer=proposer, policy=FixedLength(6),
                               draft=draft, suffix=pools)
    return engine, Engine.from_parts(oracle=ScriptedContext(model, logits), policy=FixedLength(0))


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 5}], ids=["greedy", "seeded"])
def test_a_request_sent_again_drafts_its_answer_from_the_cache_and_gets_the_same_tokens(sampling):
    engine, alone = suffix_engine(SuffixPools(10_000))
    prompt = "the same request twice"
    first = engine.generate(prompt, max_tokens=40, **sampling)
    again = engine.generate(prompt, max_tokens=40, **sampling)
    expected = alone.generate(prompt, max_tokens=40, **sampling).tokens
    assert first.tokens == again.tokens == expected
    assert first.stats.suffix_drafted == 0  # nothing kept yet
    assert again.stats.suffix_accepted >= len(expected) // 2 and again.stats.steps < first.stats.steps
    assert {r.source for r in again.stats.records if r.drafted} >= {DraftSource.SUFFIX}
    elsewhere = engine.generate(prompt, max_tokens=40, pool="someone else", **sampling)  # another pool's cache
    assert elsewhere.tokens == expected and elsewhere.stats.suffix_drafted == 0


def test_sources_label_the_caches_tokens():
    engine, _ = suffix_engine(SuffixPools(10_000))
    engine.generate("label me", max_tokens=30)
    chunks = list(engine.stream("label me", max_tokens=30, sources=True))
    assert "suffix" in {label for chunk in chunks for _, label in chunk.sources}


def test_a_resumed_batch_starts_its_suffix_cache_from_the_answers_already_written(tmp_path):
    from localspec.cli.jobs import run_batch

    first, _ = suffix_engine(SuffixPools(10_000))
    answer = first.generate("a record in one format", max_tokens=30)
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": 1, "prompt": "a record in one format", "max_tokens": 30, "raw": true}\n'
                      '{"id": 2, "prompt": "a record in one format", "max_tokens": 30, "raw": true}\n')
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": 1, "text": answer.text}) + "\n")  # an earlier run wrote id 1, then stopped
    engine, _ = suffix_engine(SuffixPools(10_000))  # a fresh process: an empty cache
    notes: list[str] = []
    summary = run_batch(str(source), str(out), open_engine=lambda: nullcontext(engine), defaults=GenerationOptions(),
                        progress=notes.append, show_bar=False)
    assert summary.skipped == 1 and any("starts from the 1 answers already in" in n for n in notes)
    record = json.loads(out.read_text().splitlines()[1])
    assert record["text"] == answer.text and record["stats"]["suffix_accepted"] > 0


def test_a_server_keeps_one_cache_per_api_key_and_reports_drafts_by_source():
    from starlette.testclient import TestClient

    from localspec.server import create_app

    engine, _ = suffix_engine(SuffixPools(10_000))
    alice, bob = "alice-" + "a" * 20, "bob-" + "b" * 20
    body = {"model": "m", "prompt": "the same request", "max_tokens": 30, "temperature": 0}

    def complete(c, key):
        r = c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return r.json()

    with TestClient(create_app(engine, model_name="m", api_key=[alice, bob]), base_url="http://localhost") as c:
        first, again, other = complete(c, alice), complete(c, alice), complete(c, bob)
        metrics = c.get("/metrics", headers={"Authorization": f"Bearer {bob}"}).text
    assert first["choices"][0]["text"] == again["choices"][0]["text"] == other["choices"][0]["text"]
    assert first["usage"]["sources"]["suffix"] == {"drafted": 0, "accepted": 0}
    assert again["usage"]["sources"]["suffix"]["accepted"] > 0  # alice's own earlier answer
    assert other["usage"]["sources"]["suffix"]["drafted"] == 0  # bob never sees alice's text
    assert sum(s["drafted"] for s in again["usage"]["sources"].values()) == again["usage"]["drafted"]
    accepted = {line.split("}")[0].split('"')[1]: float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("localspec_spec_decode_num_accepted_tokens_by_source_total{")}
    assert accepted["suffix"] == again["usage"]["sources"]["suffix"]["accepted"]


def test_the_adaptive_policies_plan_the_cache_as_a_source_of_its_own():
    from localspec.runtime.factory import default_policy
    from localspec.speculative.policy import HybridLength, LookupLength

    pools = SuffixPools(1000)
    alone = default_policy(SuffixProposer(None, pools))  # the cache with no other source
    assert isinstance(alone, LookupLength) and set(alone.free) == {DraftSource.SUFFIX}
    found = Offer(suffix=Found(np.arange(1, 9, dtype=np.int32), 30))
    assert alone.plan(found, 16, 100).source == DraftSource.SUFFIX  # nothing measured yet: the free draft
    lookup = default_policy(SuffixProposer(PromptLookupProposer(), pools))
    assert isinstance(lookup, LookupLength) and set(lookup.free) == {DraftSource.LOOKUP, DraftSource.SUFFIX}
    hybrid = default_policy(SuffixProposer(DraftModelProposer(ScriptedContext(ScriptedModel.sized(40), hashed_logits(1, 40))),
                                           pools))
    assert isinstance(hybrid, HybridLength) and set(hybrid.free) == {DraftSource.SUFFIX}  # --no-lookup, the cache on
    plan = hybrid.plan(Offer(suffix=found.suffix, model=True), 16, 100)
    assert plan.source == DraftSource.SUFFIX and 1 <= plan.length <= 8
    hybrid.observe(StepRecord(k=plan.length, drafted=plan.length, accepted=plan.length, draft_time=0.0, verify_time=0.02,
                              context=100, source=DraftSource.SUFFIX))
    assert hybrid.suffix.est.trials > 0 and hybrid.model.est.trials == 0  # the record went to the cache's policy
    assert "suffix_acceptance" in hybrid.cost_state()
