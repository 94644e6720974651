"""The engine worker: ONE thread owns the engine (llama.cpp contexts are not thread-safe) and runs
its scheduler's loop: take new jobs in, turn cancels into aborts, step (one pass of the oracle for
every sequence in a slot), deliver what each sequence emitted.

A job's events go back to whoever submitted it through a `deliver` callback, called on the worker
thread: `submit_async` turns that into an asyncio.Queue fed with `loop.call_soon_threadsafe`, so
the event loop never blocks on the engine. Each turn's events for the jobs of one event loop go in
one such call, made by a hand-over thread while the engine's waits for its decode (`_send`). A
cancelled job (a client that went away) leaves its slot at the next step boundary, within one pass.

Events, in order: STARTED (the engine accepted the request: it waits for a slot or runs) then
`outputs.Chunk`s, the last with a finish_reason; or a `Failed` (instead of STARTED when the engine
rejected the request); or CANCELLED once a cancelled job has stopped.

A job may have a time limit: when a step ends past it, the generation stops there and its last
chunk (empty text) has finish_reason "length", as if max_tokens had been reached.

At most `engine.n_slots` jobs generate at once; `max_queue` more may wait for a slot, and a job
beyond those is refused (QueueFull: a 429 with Retry-After).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from localspec.options import GenerationOptions
from localspec.outputs import Chunk, Stats
from localspec.runtime.sequence import Seq, Status
from localspec.server.metrics import Metrics

log = logging.getLogger("localspec.server")

DEFAULT_MAX_QUEUE = 32


class QueueFull(Exception):
    """Too many requests in flight; retry after `retry_after` seconds."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the server is busy; retry after {retry_after} s")
        self.retry_after = retry_after


class WorkerClosed(Exception):
    """The server is shutting down."""


class Outcome(enum.Enum):
    """How a job ended (the metrics' `outcome` label is its value)."""

    COMPLETED = "completed"  # generated to its end
    TIME_LIMIT = "time_limit"  # stopped at its time limit (a last chunk with finish_reason "length")
    CANCELLED = "cancelled"  # by its client, or by the server shutting down
    REJECTED = "rejected"  # the engine refused the request (a client error: the prompt too long, ...)
    FAILED = "failed"  # a server error

    @property
    def finished(self) -> bool:
        """It answered the request: every token it was allowed."""
        return self in (Outcome.COMPLETED, Outcome.TIME_LIMIT)


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


STARTED = _Marker("STARTED")
CANCELLED = _Marker("CANCELLED")


@dataclass
class Failed:
    error: BaseException
    client_error: bool  # the request was invalid (a 400), not a server failure


class Job:
    """One generation request: `Engine.prepare`'s arguments (`tools`: the function specs for a
    chat template that takes them), its options already checked."""

    def __init__(self, prompt: Any, options: GenerationOptions, deliver: Callable[[object], None],
                 time_limit: float | None = None, tools: list | None = None, pool: str = "") -> None:
        self.prompt = prompt
        self.options = options
        self.tools = tools
        self.pool = pool  # whose earlier requests the suffix cache drafts from (an API key's)
        self.time_limit = time_limit  # seconds the generation may run (None: no limit)
        self._deliver = deliver
        self.submitted = time.monotonic()
        self.started: float | None = None
        self.seq: Seq | None = None  # the engine's sequence, once accepted
        self.announced = False  # STARTED was delivered (the sequence took a slot)
        self.tokens = 0  # tokens generated so far
        self.steps_seen = 0  # of its sequence's steps, those the metrics have counted
        self.stats: Stats | None = None  # set when the generation completes
        self.outcome: Outcome | None = None  # set when it ends
        self.cancel_reason: str | None = None
        self._cancel = threading.Event()
        self.done = threading.Event()

    def cancel(self, reason: str = "the client went away") -> None:
        """Stop the job (before it starts, or at the next step boundary). Thread-safe, idempotent:
        the first reason given is the one logged."""
        if self.cancel_reason is None and not self.done.is_set():
            self.cancel_reason = reason
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def deliver(self, event: object) -> None:
        try:
            self._deliver(event)
        except Exception:  # the receiver is gone (e.g. its event loop closed): nobody is listening
            self.cancel()


class _ToLoop:
    """A job's events put on an asyncio.Queue of an event loop's (`submit_async`). The worker hands
    a turn's events for every job of one loop over in one wake-up of it (`EngineWorker._send`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, events: asyncio.Queue) -> None:
        self.loop, self.events = loop, events

    def __call__(self, event: object) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for events, event in batch:
        events.put_nowait(event)


class EngineWorker:
    """Runs jobs on `engine` in one thread, up to `engine.n_slots` at once. At most `max_queue`
    more wait for a slot; `submit` raises QueueFull beyond that and WorkerClosed after `close()`."""

    def __init__(self, engine, *, max_queue: int = DEFAULT_MAX_QUEUE, metrics: Metrics | None = None) -> None:
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.engine = engine
        self.scheduler = engine.scheduler
        self.slots = engine.n_slots
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self.metrics.slots.set(self.slots)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._submitted = 0  # submitted, not yet taken in by the thread
        self._active: list[Job] = []  # taken in: waiting for a slot or generating (the thread's own)
        self._outbox: list[tuple[Job, object]] = []  # events of this turn of the loop, not handed over yet
        self._in_flight = 0  # submitted and not done
        self._closed = False
        self._mean_duration = 1.0  # seconds per job, a moving average for Retry-After
        self.completed = self.cancelled = 0  # counters (also in metrics) for tests and /health
        # event loops' batches of events (`_send`), woken by a thread of their own (`_hand_over`)
        self._handoff: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._handing = threading.Thread(target=self._hand_over, name="localspec-handover", daemon=True)
        self._handing.start()
        self._thread = threading.Thread(target=self._loop, name="localspec-engine", daemon=True)
        self._thread.start()

    # -- submitting

    @property
    def queue_depth(self) -> int:
        """Jobs waiting for a slot: submitted and not yet handed to the scheduler, or waiting in it
        (a finished job whose slot is already free is not waiting, though its end is not counted yet)."""
        active = list(self._active)
        waiting = sum(1 for job in active if job.seq is not None and job.seq.status == Status.WAITING)
        return max(0, self._in_flight - len(active)) + waiting

    @property
    def running(self) -> int:
        """Jobs generating (each in a slot)."""
        return self.scheduler.busy_slots

    @property
    def busy(self) -> bool:
        return self.running > 0

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def submit(self, prompt: Any, options: GenerationOptions, deliver: Callable[[object], None], *,
               time_limit: float | None = None, tools: list | None = None, pool: str = "") -> Job:
        job = Job(prompt, options, deliver, time_limit, tools, pool)
        with self._lock:
            if self._closed:
                raise WorkerClosed("the server is shutting down")
            if self._in_flight >= self.slots + self.max_queue:
                rounds = self._in_flight / self.slots
                raise QueueFull(max(1, min(60, math.ceil(self._mean_duration * rounds))))
            self._in_flight += 1
            self._submitted += 1
            self._jobs.put(job)
        self.metrics.queue_depth.set(self.queue_depth)
        return job

    def submit_async(self, prompt: Any, options: GenerationOptions, *, time_limit: float | None = None,
                     tools: list | None = None, pool: str = "") -> tuple[Job, asyncio.Queue]:
        """Submit from the event loop; the job's events arrive on the returned asyncio.Queue."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job = self.submit(prompt, options, _ToLoop(loop, events), time_limit=time_limit, tools=tools, pool=pool)
        return job, events

    # -- lifecycle

    def close(self, timeout: float | None = 30.0) -> None:
        """Refuse new jobs, drop waiting ones, cancel the running ones and wait for the thread."""
        with self._lock:
            self._closed = True
        self._jobs.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the engine worker did not stop within %s s", timeout)

    def __enter__(self) -> "EngineWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the thread

    def _loop(self) -> None:
        closing = False
        while not closing:
            closing = self._take_new(block=not self._active)
            try:
                self._cancel_and_time_out()
                if closing:
                    break
                if self._active:  # (its jobs' sequences are in the scheduler: it has work)
                    self.scheduler.step()
                    self._pass_metrics()
                self._deliver_all()
                self._send()
            except BaseException:  # never let the thread die with requests in flight
                log.exception("engine worker: unexpected error")
                for job in list(self._active):
                    if job.seq is not None:
                        self.scheduler.abort(job.seq)
                    self._end(job, Outcome.FAILED, Failed(RuntimeError("engine worker error"), client_error=False))
        for job in list(self._active):  # shutting down: what still runs is cancelled, what waits refused
            if job.announced:
                job.cancel("the server is shutting down")
                self.scheduler.abort(job.seq)
                self._end(job, Outcome.CANCELLED, CANCELLED)
            else:
                if job.seq is not None:
                    self.scheduler.abort(job.seq)
                self._end(job, Outcome.CANCELLED, Failed(WorkerClosed("the server is shutting down"),
                                                         client_error=False))
        while True:  # submitted, never taken in
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._end(job, Outcome.CANCELLED, Failed(WorkerClosed("the server is shutting down"),
                                                         client_error=False))
        self.metrics.queue_depth.set(0)
        self.metrics.running.set(0)
        self.metrics.slots_busy.set(0)
        self._handoff.append(None)  # the hand-over thread ends once it has handed over the rest
        self._wake.set()

    def _take_new(self, *, block: bool) -> bool:
        """Take submitted jobs into the scheduler (waiting for one when nothing runs). Returns
        whether the worker is closing."""
        while True:
            try:
                job = self._jobs.get(timeout=0.5) if block else self._jobs.get_nowait()
            except queue.Empty:
                return False
            block = False
            with self._lock:
                self._submitted -= job is not None
            if job is None:
                return True
            self._start(job)

    def _start(self, job: Job) -> None:
        if job.cancelled:
            self._end(job, Outcome.CANCELLED, CANCELLED)
            return
        job.started = time.monotonic()
        try:
            seq = self.engine.prepare(job.prompt, job.options, tools=job.tools, pool=job.pool)  # checks the prompt eagerly
        except ValueError as e:  # PromptTooLongError, ChatTemplateError, a logit_bias token outside the vocabulary
            self._end(job, Outcome.REJECTED, Failed(e, client_error=True))
            return
        except Exception as e:
            log.exception("engine: the request could not start")
            self._end(job, Outcome.FAILED, Failed(e, client_error=False))
            return
        job.seq = self.scheduler.add(seq)  # STARTED once it takes a slot (until then it is queued)
        self._active.append(job)

    def _cancel_and_time_out(self) -> None:
        for job in list(self._active):
            seq = job.seq
            if job.cancelled:
                self.scheduler.abort(seq)
                if job.announced:  # what the interrupted generation drafted still counts
                    self.metrics.record_speculation(seq.stats.drafted, seq.stats.accepted)
                    log.info("generation cancelled after %d tokens (%s)", job.tokens, job.cancel_reason or "cancelled")
                self._end(job, Outcome.CANCELLED, CANCELLED)
            elif (job.time_limit is not None and seq.stats.steps and not seq.done
                  and time.monotonic() - job.started >= job.time_limit):  # a step ended past it
                self.scheduler.abort(seq)
                self._deliver_chunks(job)
                self._stop_at_time_limit(job)

    def _deliver_all(self) -> None:
        for job in list(self._active):
            self._deliver_chunks(job)
            seq = job.seq
            if seq.status == Status.FINISHED and not seq.outbox:
                s = seq.stats
                m = self.metrics
                m.prompt_tokens.inc(s.prompt_tokens)
                m.prompt_tokens_cached.inc(max(0, s.prompt_tokens - s.prompt_tokens_evaluated))
                m.record_speculation(s.drafted, s.accepted)
                m.record_host_time(s)
                self._end(job, Outcome.COMPLETED, None)
            elif seq.status == Status.ABORTED and not job.cancelled:  # a pass failed
                self._end(job, Outcome.FAILED,
                          Failed(seq.error or RuntimeError("generation failed"), client_error=False))

    def _deliver_chunks(self, job: Job) -> None:
        seq, m = job.seq, self.metrics
        if not job.announced and seq.status != Status.WAITING:
            job.announced = True
            self._post(job, STARTED)
        for record in seq.stats.records[job.steps_seen:]:
            m.record_step(record)
        job.steps_seen = len(seq.stats.records)
        while seq.outbox:
            chunk = seq.outbox.popleft()
            if chunk.tokens:
                if job.tokens == 0:
                    m.time_to_first_token.observe(time.monotonic() - job.submitted)
                job.tokens += len(chunk.tokens)
                m.tokens_generated.inc(len(chunk.tokens))
            if chunk.finish_reason is not None:
                job.stats = chunk.stats  # before the receiver sees the last chunk
            self._post(job, chunk)

    def _post(self, job: Job, event: object) -> None:
        """`job`'s next event, handed over with the rest of this turn's (`_send`)."""
        self._outbox.append((job, event))

    def _send(self) -> None:
        """Hand this turn's events over, each job's in order: those of the jobs of one event loop
        in ONE wake-up of it (a step's chunks for every streaming client at once), the others one
        by one."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, []
        batches: dict[asyncio.AbstractEventLoop, list[tuple[Job, asyncio.Queue, object]]] = {}
        for job, event in outbox:
            to = job._deliver
            if isinstance(to, _ToLoop):
                batches.setdefault(to.loop, []).append((job, to.events, event))
            else:
                job.deliver(event)
        for loop, batch in batches.items():
            jobs = [job for job, _, _ in batch]
            self._handoff.append((loop, [(events, event) for _, events, event in batch], jobs))
        if batches:
            self._wake.set()

    def _hand_over(self) -> None:
        """Wake each event loop for its batches of events (`_send`), in order. A thread of its own:
        the engine's thread only sets a flag, and this one takes its turn for the GIL when the
        engine's releases it (a decode, where a GPU computes), so the loop's work on the events
        runs while the engine waits for its device instead of in the middle of its step. (Woken
        from the engine's thread, the loop took the GIL at the wake-up's write and the engine
        waited for the loop's turn: each stream's every chunk.)"""
        while True:
            self._wake.wait()
            self._wake.clear()
            while self._handoff:
                item = self._handoff.popleft()
                if item is None:
                    return
                loop, batch, jobs = item
                try:
                    loop.call_soon_threadsafe(_put_all, batch)
                except Exception:  # its event loop is closed: nobody is listening
                    for job in jobs:
                        job.cancel()

    def _pass_metrics(self) -> None:
        m = self.metrics
        n_seqs, n_tokens = self.engine.stepper.last_pass
        if n_seqs:
            m.pass_sequences.observe(n_seqs)
            m.pass_tokens.observe(n_tokens)
        m.slots_busy.set(self.scheduler.busy_slots)
        m.running.set(self.scheduler.busy_slots)
        m.queue_depth.set(self.queue_depth)

    def _end(self, job: Job, outcome: Outcome, event: object | None) -> None:
        """The job is over: its last event (if any) delivered, counted, its slot's place freed."""
        job.outcome = outcome
        if event is not None:
            self._post(job, event)
        self._send()  # (before `done`: the job's every event is handed over, or queued for its loop's, by then)
        with self._lock:
            self._in_flight -= 1
        if job in self._active:
            self._active.remove(job)
        if job.started is not None and outcome.finished:
            self._mean_duration = 0.8 * self._mean_duration + 0.2 * (time.monotonic() - job.started)
        self.metrics.generations.labels(outcome.value).inc()
        if outcome.finished:
            self.completed += 1
        elif outcome is Outcome.CANCELLED:
            self.cancelled += 1
        self.metrics.queue_depth.set(self.queue_depth)
        job.done.set()

    def _stop_at_time_limit(self, job: Job) -> None:
        """End a generation that ran past its time limit like one that reached max_tokens: a last,
        empty chunk with finish_reason "length" and the counters so far."""
        m = self.metrics
        stats = dataclasses.replace(job.seq.stats)
        stats.total_time = time.monotonic() - (job.started or job.submitted)
        job.stats = stats
        m.prompt_tokens.inc(stats.prompt_tokens)
        m.prompt_tokens_cached.inc(max(0, stats.prompt_tokens - stats.prompt_tokens_evaluated))
        m.record_speculation(stats.drafted, stats.accepted)
        log.info("generation stopped at its time limit (%g s) after %d tokens", job.time_limit, job.tokens)
        self._end(job, Outcome.TIME_LIMIT, Chunk("", [], finish_reason="length", stats=stats))
