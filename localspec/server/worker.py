"""The engine worker: ONE thread owns the engine (llama.cpp contexts are not thread-safe) and runs
queued generation jobs one at a time.

A job's events go back to whoever submitted it through a `deliver` callback, called on the worker
thread: `submit_async` turns that into an asyncio.Queue fed with `loop.call_soon_threadsafe`, so
the event loop never blocks on the engine. Each engine chunk is one speculative step; the worker
checks the job's cancel flag before every step and closes the engine's generator, so a cancelled
job (a client that went away) stops within one step and frees the engine for the next one.

Events, in order: STARTED (the engine accepted the request) then `outputs.Chunk`s, the last with
a finish_reason; or a `Failed` (instead of STARTED when the engine rejected the request); or
CANCELLED once a cancelled job has stopped.

A job may have a time limit: when a step ends past it, the generation stops there and its last
chunk (empty text) has finish_reason "length", as if max_tokens had been reached.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..outputs import Chunk, Stats
from .metrics import Metrics

log = logging.getLogger("localspec.server")

DEFAULT_MAX_QUEUE = 32


class QueueFull(Exception):
    """Too many requests in flight; retry after `retry_after` seconds."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the server is busy; retry after {retry_after} s")
        self.retry_after = retry_after


class WorkerClosed(Exception):
    """The server is shutting down."""


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
    """One generation request. `prompt` and `options` are `Engine.stream`'s arguments."""

    def __init__(self, prompt: Any, options: dict[str, Any], deliver: Callable[[object], None],
                 time_limit: float | None = None) -> None:
        self.prompt = prompt
        self.options = options
        self.time_limit = time_limit  # seconds the generation may run (None: no limit)
        self._deliver = deliver
        self.submitted = time.monotonic()
        self.started: float | None = None
        self.tokens = 0  # tokens generated so far
        self.stats: Stats | None = None  # set when the generation completes
        self.outcome: str | None = None  # completed | time_limit | cancelled | rejected | failed
        self.cancel_reason: str | None = None
        self._cancel = threading.Event()
        self.done = threading.Event()

    def cancel(self, reason: str = "the client went away") -> None:
        """Stop the job (before it starts, or within one speculative step). Thread-safe, idempotent:
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


class EngineWorker:
    """Runs jobs on `engine` in one thread. At most `max_queue` jobs wait while one runs; `submit`
    raises QueueFull beyond that and WorkerClosed after `close()`."""

    def __init__(self, engine, *, max_queue: int = DEFAULT_MAX_QUEUE, metrics: Metrics | None = None) -> None:
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._running: Job | None = None
        self._closed = False
        self._mean_duration = 1.0  # seconds per job, a moving average for Retry-After
        self.completed = self.cancelled = 0  # counters (also in metrics) for tests and /health
        self._thread = threading.Thread(target=self._loop, name="localspec-engine", daemon=True)
        self._thread.start()

    # -- submitting

    @property
    def queue_depth(self) -> int:
        """Jobs waiting (not counting the one running)."""
        return self._waiting

    @property
    def busy(self) -> bool:
        return self._running is not None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def submit(self, prompt: Any, options: dict[str, Any], deliver: Callable[[object], None], *,
               time_limit: float | None = None) -> Job:
        job = Job(prompt, options, deliver, time_limit)
        with self._lock:
            if self._closed:
                raise WorkerClosed("the server is shutting down")
            in_flight = self._waiting + (self._running is not None)
            if in_flight > self.max_queue:
                raise QueueFull(max(1, min(60, math.ceil(self._mean_duration * in_flight))))
            self._waiting += 1
            self.metrics.queue_depth.set(self._waiting)
            self._jobs.put(job)
        return job

    def submit_async(self, prompt: Any, options: dict[str, Any], *,
                     time_limit: float | None = None) -> tuple[Job, asyncio.Queue]:
        """Submit from the event loop; the job's events arrive on the returned asyncio.Queue."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job = self.submit(prompt, options, lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
                          time_limit=time_limit)
        return job, events

    # -- lifecycle

    def close(self, timeout: float | None = 30.0) -> None:
        """Refuse new jobs, drop waiting ones, cancel the running one and wait for the thread."""
        with self._lock:
            self._closed = True
            running = self._running
        if running is not None:
            running.cancel("the server is shutting down")
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                with self._lock:
                    self._waiting -= 1
                job.cancel("the server is shutting down")
                job.outcome = "cancelled"
                job.deliver(Failed(WorkerClosed("the server is shutting down"), client_error=False))
                job.done.set()
        self.metrics.queue_depth.set(0)
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
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                self._waiting -= 1
                self._running = job
            self.metrics.queue_depth.set(self._waiting)
            self.metrics.running.set(1)
            t0 = time.monotonic()
            try:
                self._execute(job)
            except BaseException:  # never let the thread die with requests queued
                log.exception("engine worker: unexpected error")
                job.outcome = "failed"
            finally:
                self._mean_duration = 0.8 * self._mean_duration + 0.2 * (time.monotonic() - t0)
                with self._lock:
                    self._running = None
                self.metrics.running.set(0)
                self.metrics.generations.labels(job.outcome or "failed").inc()
                if job.outcome in ("completed", "time_limit"):
                    self.completed += 1
                elif job.outcome == "cancelled":
                    self.cancelled += 1
                job.done.set()

    def _execute(self, job: Job) -> None:
        m = self.metrics
        if job.cancelled:
            job.outcome = "cancelled"
            job.deliver(CANCELLED)
            return
        job.started = time.monotonic()
        try:
            stream = self.engine.stream(job.prompt, **job.options)  # validates eagerly
        except ValueError as e:  # PromptTooLongError, ChatTemplateError, bad option values
            job.outcome = "rejected"
            job.deliver(Failed(e, client_error=True))
            return
        except Exception as e:
            log.exception("engine: the request could not start")
            job.outcome = "failed"
            job.deliver(Failed(e, client_error=False))
            return
        job.deliver(STARTED)
        running: Stats | None = None  # the engine's running counters (chunks carry them)
        deadline = None if job.time_limit is None else job.started + job.time_limit
        try:
            while not job.cancelled:
                chunk: Chunk | None = next(stream, None)
                if chunk is None:  # cannot happen: the last chunk has a finish_reason
                    break
                if chunk.tokens:
                    if job.tokens == 0:
                        m.time_to_first_token.observe(time.monotonic() - job.submitted)
                    job.tokens += len(chunk.tokens)
                    m.tokens_generated.inc(len(chunk.tokens))
                running = chunk.stats or running
                if chunk.finish_reason is not None:
                    s = job.stats = chunk.stats
                    m.prompt_tokens.inc(s.prompt_tokens)
                    m.prompt_tokens_cached.inc(max(0, s.prompt_tokens - s.prompt_tokens_evaluated))
                    m.record_speculation(s.drafted, s.accepted)
                    job.outcome = "completed"
                    job.deliver(chunk)
                    return
                job.deliver(chunk)
                if deadline is not None and time.monotonic() >= deadline and not job.cancelled:
                    self._stop_at_time_limit(job, running)
                    return
            job.outcome = "cancelled"
            if running is not None:  # what the interrupted generation drafted still counts
                m.record_speculation(running.drafted, running.accepted)
            log.info("generation cancelled after %d tokens (%s)", job.tokens, job.cancel_reason or "cancelled")
            job.deliver(CANCELLED)
        except Exception as e:
            log.exception("engine: generation failed")
            job.outcome = "failed"
            job.deliver(Failed(e, client_error=False))
        finally:
            stream.close()

    def _stop_at_time_limit(self, job: Job, running: Stats | None) -> None:
        """End a generation that ran past its time limit like one that reached max_tokens: a last,
        empty chunk with finish_reason "length" and the counters so far."""
        m = self.metrics
        stats = dataclasses.replace(running) if running is not None else Stats()
        stats.total_time = time.monotonic() - (job.started or job.submitted)
        job.stats = stats
        m.prompt_tokens.inc(stats.prompt_tokens)
        m.prompt_tokens_cached.inc(max(0, stats.prompt_tokens - stats.prompt_tokens_evaluated))
        m.record_speculation(stats.drafted, stats.accepted)
        job.outcome = "time_limit"
        log.info("generation stopped at its time limit (%g s) after %d tokens", job.time_limit, job.tokens)
        job.deliver(Chunk("", [], finish_reason="length", stats=stats))
