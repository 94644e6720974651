"""Pass-cost models fitted from steps, and their store between processes."""

import json
import os
import threading

import numpy as np
import pytest

from localspec.runtime.learning import CostStore, file_fingerprint
from localspec.speculative.costs import DRAFT_SHAPE, VERIFY_SHAPE, PassCost


def cpu_like(n, c):
    """A CPU oracle without flash attention: 17 ms for one token, a jump to the matrix-matrix
    kernels, 2.4 ms per token, and attention that grows with the context."""
    return 0.017 + 0.006 * (n > 1) + 0.0024 * n + (0.002 + 0.0008 * n) * c / 1024


def test_the_fit_recovers_a_cost_that_has_the_models_form():
    cost = PassCost(VERIFY_SHAPE)
    for _ in range(5):  # the context terms move from the prior only on evidence from many contexts
        for c in (64, 300, 700, 1500):
            for n in (1, 2, 5, 9, 17):
                cost.observe(n, c, cpu_like(n, c))
    for c in (100, 1000, 2000):  # contexts it never saw, the longest past them all
        ns = np.arange(1, 18)
        assert cost.predict(ns, c) == pytest.approx([cpu_like(n, c) for n in ns], rel=0.02)


def test_before_any_step_the_prior_is_scaled_by_the_first_measurement():
    cost = PassCost(VERIFY_SHAPE)
    assert not cost.ready
    with pytest.raises(ValueError):
        cost(1, 0)
    cost.observe(1, 50, 0.020)
    assert cost.ready
    assert cost(1, 50) == pytest.approx(0.020, rel=0.01)
    # nothing measured past one token: the prior's CPU-like shape, 1 + 0.2 [n > 1] + 0.1 (n - 1)
    assert cost(9, 50) == pytest.approx(0.020 * (1 + 0.2 + 0.8), rel=0.05)
    draft = PassCost(DRAFT_SHAPE)
    draft.observe(3, 50, 0.032)  # a proposal that evaluated 3 tokens: 3.2 one-token decodes' worth
    assert draft(1, 50) == pytest.approx(0.012, rel=0.05)


def test_a_machine_slowing_down_within_a_request_is_not_read_as_attention_growing_with_the_context():
    cost = PassCost(VERIFY_SHAPE)
    for c in range(100, 400):  # one long answer, during which the machine gets 40% slower
        slowdown = 1 + 0.4 * (c - 100) / 300
        cost.observe(1 if c % 5 else 9, c, slowdown * cpu_like(1 if c % 5 else 9, 100))
    # now at 1.4x: the fit follows the machine, and does not extrapolate a steep context slope
    assert cost(9, 400) == pytest.approx(1.4 * cpu_like(9, 100), rel=0.1)
    assert cost(9, 2000) < 1.4 * cpu_like(9, 2000) * 1.2


def test_it_follows_a_machine_that_slows_down_and_shrugs_off_a_hiccup():
    cost = PassCost(VERIFY_SHAPE)
    for _ in range(50):
        for n in (1, 9):
            cost.observe(n, 100, cpu_like(n, 100))
    cost.observe(9, 100, 1.0)  # one step stalled by the VM: clipped to twice the prediction
    assert cost(9, 100) == pytest.approx(cpu_like(9, 100), rel=0.1)
    for _ in range(300):  # the machine is 30% slower from now on
        for n in (1, 9):
            cost.observe(n, 100, 1.3 * cpu_like(n, 100))
    assert cost(9, 100) == pytest.approx(1.3 * cpu_like(9, 100), rel=0.02)


def test_a_fit_that_started_on_a_stall_comes_down_and_stalls_among_steps_barely_move_it():
    cost = PassCost(DRAFT_SHAPE)
    cost.observe(2, 50, 0.300)  # the first proposal ever, caught in a 300 ms stall (12 ms is its cost)
    for i in range(40):
        n = 2 + i % 8
        cost.observe(n, 50, 0.006 * n)
    assert cost.predict(np.array([2, 9]), 50) == pytest.approx([0.012, 0.054], rel=0.15)
    for i in range(60):  # one step in ten stalls for 300 ms
        n = 2 + i % 8
        cost.observe(n, 50, 0.300 if i % 10 == 5 else 0.006 * n)
    assert cost.predict(np.array([2, 9]), 50) == pytest.approx([0.012, 0.054], rel=0.3)


def test_predictions_never_fall_with_a_longer_context():
    """Steps at short contexts only, whose per-token cost happens to fall a little as the context
    grows (a warming machine, the draft stopping earlier later on): the fit must not carry that to
    long contexts, where attention only adds (the default pair's kept fit once predicted a 17-token
    pass at 53 ms at 2048 tokens of context against 69 ms at 256)."""
    cost = PassCost(VERIFY_SHAPE)
    rng = np.random.default_rng(0)
    for _ in range(400):
        c = int(rng.integers(60, 400))
        n = int(rng.choice([1, 2, 5, 9, 17]))
        cost.observe(n, c, 0.017 + 0.006 * (n > 1) + 0.0024 * n * (1.0 - 0.3 * c / 1024))
    w = cost.weights()
    assert w[3] >= 0.0 and w[4] >= 0.0
    for n in (1, 9, 17):
        assert cost(n, 256) <= cost(n, 1024) <= cost(n, 2048)
    assert cost(17, 256) == pytest.approx(0.017 + 0.006 + 0.0024 * 17 * (1 - 0.3 / 4), rel=0.05)  # in range: as seen


def test_predictions_never_fall_with_more_tokens():
    cost = PassCost(VERIFY_SHAPE)
    for _ in range(5):  # noisy data that would fit a falling line
        cost.observe(2, 100, 0.030)
        cost.observe(16, 100, 0.025)
    pred = cost.predict(np.arange(1, 18), 100)
    assert np.all(np.diff(pred) >= 0) and np.all(pred > 0)


def test_state_round_trips_and_the_history_is_capped(tmp_path):
    cost = PassCost(VERIFY_SHAPE)
    for _ in range(200):
        for n in (1, 5, 9):
            cost.observe(n, 300, cpu_like(n, 300))
    store = CostStore(tmp_path)
    key = {"model": "abc", "threads": 2}
    store.save("verify", key, cost.state(max_weight=32))
    again = PassCost(VERIFY_SHAPE)
    again.load(store.load("verify", key))
    assert again.weight == pytest.approx(32)  # counts as 32 steps here, so fresh steps soon outweigh it
    # the same fit (the prior weighs a little more against the shrunk history)
    assert again.predict(np.arange(1, 18), 300) == pytest.approx(cost.predict(np.arange(1, 18), 300), rel=0.01)
    assert store.load("verify", {"model": "abc", "threads": 1}) is None  # another key: nothing
    assert store.load("draft", key) is None


def test_a_damaged_or_foreign_file_reads_as_nothing(tmp_path):
    store = CostStore(tmp_path)
    key = {"model": "abc"}
    path = store.path("verify", key)
    path.parent.mkdir(parents=True, exist_ok=True)
    for content in ("{not json", json.dumps([1, 2]), json.dumps({"version": 1, "identity": {"model": "xyz"},
                                                                 "state": {}})):
        path.write_text(content)
        assert store.load("verify", key) is None
    cost = PassCost()
    with pytest.raises(ValueError):
        cost.load({"gram": [[1.0]], "moment": [1.0], "scale": 0.01})


def test_what_an_engine_keeps_after_a_request_is_written_on_another_thread(tmp_path, monkeypatch):
    """`save_later` (a CostBook's, after each request) hands the state to the writer's thread and
    returns while the file is still being written; a newer state of the same file replaces one not
    written yet; `load` and `flush` wait for what was handed over; a failed write is logged and
    later ones still go out."""
    from localspec.runtime import learning

    gate, writing = threading.Event(), threading.Event()
    real = learning.write_text_atomically

    def slow(path, text):
        writing.set()
        gate.wait(30)
        real(path, text)

    monkeypatch.setattr(learning, "write_text_atomically", slow)
    store = CostStore(tmp_path)
    key = {"model": "abc"}
    path = store.path("verify", key)
    try:
        store.save_later(path, key, {"scale": 1})
        assert writing.wait(30)  # the writer's thread is in the middle of the write ...
        assert not path.exists()  # ... and the caller went on
        store.save_later(path, key, {"scale": 2})
        store.save_later(path, key, {"scale": 3})  # replaces 2, not yet written
    finally:
        gate.set()  # (the writer is the process's: never leave it held)
    assert store.load("verify", key) == {"scale": 3}

    blocked = CostStore(tmp_path / "file" / "costs")
    (tmp_path / "file").write_text("")
    blocked.save_later(blocked.path("verify", key), key, {"scale": 4})  # cannot be written: logged
    store.save_later(path, key, {"scale": 5})
    store.flush()
    assert json.loads(path.read_text())["state"] == {"scale": 5}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_child_forked_while_a_write_runs_saves_and_flushes_on_its_own(tmp_path, monkeypatch):
    """A process forked while the writer's thread was in the middle of a write (busy) with another
    file waiting behind it: the child's load writes what was waiting on a writer of its own instead
    of waiting for a thread the child does not have."""
    import time

    from localspec.runtime import learning

    parent, gate, writing = os.getpid(), threading.Event(), threading.Event()
    real = learning.write_text_atomically

    def slow(path, text):
        if os.getpid() == parent:
            writing.set()
            gate.wait(30)
        real(path, text)

    monkeypatch.setattr(learning, "write_text_atomically", slow)
    store, key = CostStore(tmp_path), {"model": "abc"}
    try:
        store.save_later(store.path("verify", key), key, {"scale": 1})
        assert writing.wait(30)
        store.save_later(store.path("draft", key), key, {"scale": 2})  # waits behind it
        pid = os.fork()
        if pid == 0:  # the child: report by exit code, never return into pytest
            code = 1
            try:
                code = 0 if store.load("draft", key) == {"scale": 2} else 2
            finally:
                os._exit(code)
        deadline = time.monotonic() + 15
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on its writer")
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        gate.set()
    assert store.load("verify", key) == {"scale": 1} and store.load("draft", key) == {"scale": 2}


def test_an_unwritable_store_does_not_fail_the_caller(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    CostStore(blocker / "costs").save("verify", {"model": "abc"}, {"scale": 1})  # logged, not raised


def test_the_fingerprint_follows_the_content_not_the_name(tmp_path):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    data = bytes(range(256)) * 20000  # 5 MB: the three samples do not overlap
    a.write_bytes(data)
    b.write_bytes(data)
    changed = bytearray(data)
    changed[len(data) // 2] ^= 1  # one byte in the middle sample
    c.write_bytes(bytes(changed))
    assert file_fingerprint(a) == file_fingerprint(b) != file_fingerprint(c)


def test_a_pass_of_several_sequences_and_one_split_in_passes():
    """t = w0 + w1 [N>1] + w2 N + (w3 sum c + w4 sum n c)/1024 + w5 (S - 1), learned from passes of
    one sequence and of several; a decode llama.cpp ran as several passes adds their features."""
    from localspec.speculative.costs import PassCost

    def truth(ns, cs):
        return 0.017 + 0.004 * (sum(ns) > 1) + 0.0034 * sum(ns) + 0.001 * (len(ns) - 1) + 0.00001 * sum(cs) / 1024

    cost = PassCost(decay=1.0)
    rng = np.random.default_rng(0)
    for _ in range(400):
        s = int(rng.integers(1, 9))
        ns = [int(rng.integers(1, 6)) for _ in range(s)]
        cs = [int(rng.integers(10, 300)) for _ in range(s)]
        cost.observe_pass(ns, cs, truth(ns, cs))
    for ns in ([1], [4], [1] * 4, [1] * 8, [3] * 8, [5, 1, 1, 2]):
        cs = [100] * len(ns)
        assert cost.pass_time(ns, cs) == pytest.approx(truth(ns, cs), rel=0.03)
    assert cost.pass_time([1], [100]) == pytest.approx(cost(1, 100))  # one sequence: the one-sequence form
    assert cost.token_time(100) == pytest.approx(0.0034, rel=0.05)
    assert cost.pass_overhead(100) == pytest.approx(0.021, rel=0.1)
    split = PassCost(decay=1.0)
    for _ in range(3):
        split.observe_passes([([1, 1], [50, 50]), ([2], [51])], truth([1, 1], [50, 50]) + truth([2], [51]))
    assert split.observations == 3


def test_observations_folded_in_one_go_make_the_sums_added_one_by_one():
    """PassCost keeps each observation aside and adds the pending ones together when a fit or its
    state is wanted (`_fold`): the decayed sums are those of adding each in turn, however fits and
    observations interleave; a cost never asked for folds them all the same."""
    rng = np.random.default_rng(4)
    cost = PassCost(decay=0.97)
    from localspec.speculative.costs import START

    for _ in range(START):
        cost.observe(1, 100, 0.02)  # a scale, so that it can fit (and no first passes left to settle)
    cost._pending, cost.gram, cost.moment, cost.weight = [], np.zeros((6, 6)), np.zeros(6), 0.0
    gram, moment, weight = np.zeros((6, 6)), np.zeros(6), 0.0
    for i in range(400):
        phi, seconds = rng.uniform(0, 3, 6), float(rng.uniform(0.01, 0.05))
        cost._add(phi, seconds)
        gram, moment, weight = 0.97 * gram + np.outer(phi, phi), 0.97 * moment + phi * seconds, 0.97 * weight + 1.0
        assert len(cost._pending) < 64
        if rng.random() < 0.05:
            cost._w = None
            cost.weights()  # a fit takes every observation so far
            assert not cost._pending
            np.testing.assert_allclose(cost.gram, gram, rtol=1e-9)
    state = cost.state(max_weight=1e9)
    np.testing.assert_allclose(np.array(state["gram"]), gram, rtol=1e-9)
    np.testing.assert_allclose(np.array(state["moment"]), moment, rtol=1e-9)
    assert state["weight"] == pytest.approx(weight, rel=1e-12)
