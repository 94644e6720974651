"""Continuous batching: which sequences the engine's next pass carries.

Requests join and leave at step boundaries, first come, first served. A sequence waits until a
slot is free (a slot: a sequence id of both contexts, `Slots.n_slots` of them), takes the lowest
free one (what another slot's cache shares with its prompt is copied, and what the slot held moves
to a free one first: a conversation's next turn finds its own), fills the
oracle's cache with its prompt in chunks of at most `prefill_chunk` tokens per pass while others
run (or `n_batch` when nobody is streaming; a prompt that shares a prefix with one an earlier
sequence is still filling waits for it and copies it: requests with one system prompt that arrive
together evaluate it once), then steps with the running ones until it finishes or
is aborted. The chunk that finishes a prompt carries its last token too where the budget has room
for it: that pass's logits there give the first token (llama-server's way: one pass less before the
first token than evaluating the last token in a step of its own). Each `step()` is ONE oracle pass
(`Step.run`), which returns what happened; `apply` lands it (`runtime.apply`: history, outbox,
stats, what the policies learn) and changes the statuses, the only place they change (vLLM's
`update_from_output`).

The scheduler is driven by one thread: the server's worker (its loop: take new jobs in, turn
cancels into aborts, step, deliver), a batch file's runner, or `Engine.stream` for one sequence.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Protocol, Sequence

from localspec.outputs import Chunk
from localspec.runtime.sequence import Seq, Status, StepOutcome

if TYPE_CHECKING:
    from localspec.runtime.step import StepOutput

log = logging.getLogger("localspec.runtime.scheduler")

PREFILL_CHUNK = 256  # prompt tokens a pass carries while other sequences stream (a pass of 256 costs ~0.4 s here)


class Slots(Protocol):
    """The slots a scheduler fills (`runtime.slots.Slots`)."""

    n_slots: int
    oracle: object  # a LlamaContext: `seq_tokens(slot)`, `n_batch`

    def admit(self, seq: Seq, free: Sequence[int] = (), busy: Sequence[int] = ()) -> int: ...

    def filling_for(self, seq: Seq, active: Sequence[Seq]) -> bool: ...

    def share(self, seq: Seq, busy: Sequence[int] = ()) -> int: ...


class Stepper(Protocol):
    """One pass at a time (`runtime.step.Step`): it returns what happened, and writes none of it."""

    def run(self, running: Sequence[Seq], prefill: Mapping[Seq, int] | None = None, *,
            queued: bool = False) -> StepOutput: ...


class Scheduler:
    """Who joins, who runs, who leaves. `slots`: the slots it fills (`caches`); `step`: runs one pass;
    `land`: applies what a pass did to the requests (`runtime.apply.Apply`) and says who finished
    and whose prompt is in."""

    def __init__(self, slots: Slots, step: Stepper, land: Callable[[StepOutput], list[StepOutcome]], *,
                 prefill_chunk: int = PREFILL_CHUNK) -> None:
        self.caches, self.stepper, self.land = slots, step, land
        self.prefill_chunk = prefill_chunk
        self.slots: list[Seq | None] = [None] * slots.n_slots
        self.waiting: deque[Seq] = deque()
        self._waited: set[int] = set()  # sequences that waited for another to fill a prefix they share

    # -- what is there

    @property
    def active(self) -> list[Seq]:
        """The sequences in a slot, in the order they came."""
        return sorted((s for s in self.slots if s is not None), key=lambda s: s.id)

    @property
    def busy_slots(self) -> int:
        return sum(s is not None for s in self.slots)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    # -- joining and leaving

    def add(self, seq: Seq) -> Seq:
        """Queue a sequence (from `Engine.new_seq`)."""
        seq.t_start = time.perf_counter()
        seq.status = Status.WAITING
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Seq, error: BaseException | None = None) -> None:
        """Stop `seq` now (between passes): out of the queue, or out of its slot (its cache stays,
        for a request that shares its prompt). Idempotent; a finished sequence stays finished."""
        if seq.done:
            return
        seq.status, seq.error = Status.ABORTED, error
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)

    def _free(self, seq: Seq) -> None:
        self._waited.discard(seq.id)
        if seq.slot is not None and self.slots[seq.slot] is seq:
            self.slots[seq.slot] = None

    def _admit(self) -> None:
        """Waiting sequences into free slots, first come first served."""
        while self.waiting:
            free = [i for i, s in enumerate(self.slots) if s is None]
            if not free:
                return
            seq = self.waiting.popleft()
            # the lowest free slot: busy slots stay contiguous, and llama.cpp runs a batch of
            # consecutive sequence ids in one pass (`LlamaContext.ubatches`); a prefix another slot
            # holds is copied over (`Slots.admit`)
            slot = min(free)
            busy = [i for i, s in enumerate(self.slots) if s is not None]
            self.slots[slot], seq.slot = seq, slot
            seq.stats.prompt_tokens_evaluated = self.caches.admit(seq, free, busy)
            seq.status = Status.PREFILL

    # -- one pass

    def step(self) -> list[Seq]:
        """Admit who can join, then ONE pass of the engine over every sequence in a slot: running
        ones step, prompts fill. Returns the sequences the pass touched (their outboxes may have
        new chunks; finished ones have left their slots)."""
        self._admit()
        active = self.active
        running = [s for s in active if s.status == Status.RUNNING]
        oracle = self.caches.oracle
        budget = self.prefill_chunk if running else oracle.n_batch
        prefill: dict[Seq, int] = {}
        for seq in active:
            if seq.status != Status.PREFILL or budget <= 0:
                continue
            if self.caches.filling_for(seq, active):  # it copies that prefix once it is in
                self._waited.add(seq.id)
                continue
            if seq.id in self._waited:
                self._waited.discard(seq.id)
                seq.stats.prompt_tokens_evaluated -= self.caches.share(seq, [s.slot for s in active if s is not seq])
            todo = len(seq.history) - 1 - len(oracle.seq_tokens(seq.slot))  # the prompt but its last token
            n = min(todo, budget)
            if n == todo and n + 1 <= budget and seq.request.prompt_logprobs is None:
                n += 1  # ... and the last: the pass yields the first token (`Step` sees the chunk end the history)
            if n > 0:
                prefill[seq] = n
                budget -= n
            elif todo <= 0:  # nothing to evaluate (its prompt was cached): it runs in this pass
                self._start_running(seq)
                running.append(seq)
        if not running and not prefill:
            return []
        touched = running + list(prefill)
        try:
            self.apply(self.stepper.run(running, prefill, queued=bool(self.waiting)))
        except Exception as e:  # a failed pass fails the sequences in it, not the others queued
            log.exception("engine: a pass failed")
            for seq in touched:
                self.abort(seq, e)
        return touched

    def apply(self, output: StepOutput) -> None:
        """What a pass did lands on the requests (`land`: history, outbox, stats, what the
        policies learn); then a finished sequence leaves its slot, one whose prompt is in runs."""
        for outcome in self.land(output):
            seq = outcome.seq
            if outcome.finish_reason is not None:
                seq.finish_reason, seq.structure = outcome.finish_reason, outcome.structure
                seq.status = Status.FINISHED
                self._free(seq)
            elif outcome.prompt_done:
                self._start_running(seq)

    @staticmethod
    def _start_running(seq: Seq) -> None:
        seq.status = Status.RUNNING
        if not seq.stats.prompt_time:  # (set on landing where the prompt's pass gave the first token)
            seq.stats.prompt_time = time.perf_counter() - seq.t_start

    def run(self, seq: Seq) -> Iterator[Chunk]:
        """Add `seq` and step until it is done, yielding its chunks as they come (the generator of
        `Engine.stream`); closing the generator early aborts it."""
        self.add(seq)
        try:
            while True:
                while seq.outbox:
                    yield seq.outbox.popleft()
                if seq.done:
                    if seq.status == Status.ABORTED and seq.error is not None:
                        raise seq.error
                    return
                self.step()
        finally:
            self.abort(seq)
