"""What the length policy learned, kept between processes: `CostStore` holds fitted pass costs and
acceptance estimates in the cache, one file per key in `<cache>/costs` (`$LOCALSPEC_COST_CACHE`
moves it); the key holds everything that changes the costs (model file, threads, llama.cpp build
and backends, CPU model, attention kernel, GPU offload), so a changed setting starts afresh.
`CostBook` is an engine's: the store and the key of each kind of state (see
`speculative.policy.Learning.cost_state`), written after each request by a thread of its own
(`_Writer`: the engine's thread does not wait for the files). `Learner` is the engine's learning:
the policy requests fork, where its state is kept, and what the costs every request shares learn
from each pass (on landing, `runtime.apply`). The policy's state itself is `speculative.costs`' fit and
`speculative.policy`'s estimates.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import platform
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from localspec.cache import cache_dir, write_text_atomically
from localspec.llama.bindings import VERSION, llama_cpp
from localspec.runtime.batch_judge import BatchJudge
from localspec.speculative.policy import LengthPolicy, learns

log = logging.getLogger("localspec.runtime.learning")
ENGINE_KINDS = ("batch",)  # kinds of learned state the engine keeps beside its policy's (`batch_judge`)

# 7: a decode whose outputs nobody read had its GPU time land in the next decode (a request's first
# one-token step seemed to cost its prompt): costs kept before that was fixed are dropped
STATE_VERSION = 7
# the longest prompt chunk a pass may carry and still teach the verify passes' costs: a verify row's
# length (prompt lookup drafts up to factory.LOOKUP_DRAFT_MAX = 64 tokens; factory imports this module)
SHORT_CHUNK = 65


def file_fingerprint(path: str | os.PathLike) -> str:
    """A cheap content fingerprint of a (large) file: its size and three 1 MiB samples (start,
    middle, end). Reading gigabytes to hash them on every start would cost more than it saves."""
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    chunk = 1 << 20
    with open(path, "rb") as f:
        for offset in sorted({0, max(0, size // 2 - chunk // 2), max(0, size - chunk)}):
            f.seek(offset)
            h.update(f.read(chunk))
    return h.hexdigest()[:32]


@lru_cache(maxsize=1)
def machine_identity() -> dict[str, str]:
    """The CPU model and llama.cpp's build and backends: what a cost depends on beyond the model."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        system = llama_cpp.llama_print_system_info().decode("utf-8", errors="replace").strip()
    except Exception:  # pragma: no cover - every binding has it; the key then just says less
        system = ""
    return {"cpu": cpu, "llama_cpp_python": VERSION, "system": system}


class CostStore:
    """Fitted cost models and acceptance estimates in `<cache>/costs/<kind>-<key hash>.json`.

    `identity` (a JSON-able mapping) is the key; it is stored beside the state so a person can tell
    what a file is about. A file that is missing, unreadable or of another key reads as nothing."""

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        if directory is None:
            directory = os.environ.get("LOCALSPEC_COST_CACHE") or cache_dir() / "costs"
        self.directory = Path(directory)

    def path(self, kind: str, identity: Mapping[str, Any]) -> Path:
        key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
        return self.directory / f"{kind}-{key}.json"

    def load(self, kind: str, identity: Mapping[str, Any]) -> dict[str, Any] | None:
        """What was saved for `kind` under `identity` (in this process too: it waits for the writer)."""
        _WRITER.flush()
        path = self.path(kind, identity)
        try:
            data = json.loads(path.read_text("utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.debug("ignoring %s: %s", path, e)
            return None
        if not isinstance(data, dict) or data.get("version") != STATE_VERSION or data.get("identity") != dict(identity):
            return None
        state = data.get("state")
        return state if isinstance(state, dict) else None

    def save(self, kind: str, identity: Mapping[str, Any], state: Mapping[str, Any]) -> None:
        """Write atomically (a reader never sees half a file); a failure is logged, never raised:
        a cost model is worth keeping, not worth failing a generation for."""
        _write(self.path(kind, identity), _document(identity, state))

    def save_later(self, path: Path, identity: Mapping[str, Any], state: Mapping[str, Any]) -> None:
        """`save` to `path` (this store's, for a kind and identity) on the writer's thread; `state`
        must be a snapshot nobody changes after (`Learning.cost_state`'s are)."""
        identity = dict(identity)
        _WRITER.put(path, lambda: _document(identity, state))

    @staticmethod
    def flush(timeout: float | None = None) -> None:
        """Wait until what `save_later` was handed is written."""
        _WRITER.flush(timeout)


def _document(identity: Mapping[str, Any], state: Mapping[str, Any]) -> str:
    return json.dumps({"version": STATE_VERSION, "identity": dict(identity), "state": dict(state)})


def _write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, text)
    except OSError as e:
        log.debug("could not save %s: %s", path, e)


class _Writer:
    """Writes cost files on a thread of its own, the newest text of each file once. An engine saves
    what its policy learned after every request: five files, each written and renamed into place,
    ~2 ms on a quiet local disk (far more on a busy or networked one), which on its own thread would
    hold up every sequence it generates (on a GPU, one or two tokens' time each request)."""

    def __init__(self) -> None:
        self._pending: dict[Path, Callable[[], str]] = {}
        self._busy = False
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def put(self, path: Path, text: Callable[[], str]) -> None:
        with self._cv:
            self._pending[path] = text  # a newer state of the same file replaces one not written yet
            self._running()
            self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> None:
        with self._cv:
            if self._pending:
                self._running()
            self._cv.wait_for(lambda: not self._pending and not self._busy, timeout)

    def _running(self) -> None:
        """The thread, started if it is not running (the first save, or a process forked since)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="localspec-costs", daemon=True)
            self._thread.start()

    def _after_fork(self) -> None:
        """In a forked child: a lock of its own (the parent's writer may have held the old one);
        what was pending is written by the child's own thread when it next saves or flushes."""
        self._cv, self._thread, self._busy = threading.Condition(), None, False

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending)
                batch, self._pending, self._busy = self._pending, {}, True
            try:
                for path, text in batch.items():
                    try:
                        _write(path, text())
                    except Exception:  # never let the thread die: later saves still go out
                        log.exception("could not save %s", path)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()


_WRITER = _Writer()
atexit.register(_WRITER.flush, 30.0)  # what the last request learned, before the process ends
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WRITER._after_fork)


class CostBook:
    """Where a length policy's learned state is kept between processes: the store, and the identity
    each kind of state is kept under there (what it depends on: model files, threads, attention
    kernel, machine, ...). See `policy.Learning.cost_state`."""

    def __init__(self, store: CostStore, keys: Mapping[str, Mapping[str, Any]]) -> None:
        self.store = store
        self.keys = {kind: dict(identity) for kind, identity in keys.items()}
        self._paths = {kind: store.path(kind, identity) for kind, identity in self.keys.items()}

    def load(self, policy) -> None:
        """Hand `policy` what earlier processes kept for it (every kind but the engine's own)."""
        for kind in self.keys:
            if kind not in ENGINE_KINDS:
                self.load_into(kind, lambda state, kind=kind: policy.load_cost_state(kind, state))

    def load_into(self, kind: str, take: Callable[[dict[str, Any]], None]) -> None:
        """Hand `take` what earlier processes kept of `kind`, if any; a malformed state (`take`
        raises KeyError, TypeError or ValueError) is ignored."""
        state = self.store.load(kind, self.keys[kind]) if kind in self.keys else None
        try:
            if state:
                take(state)
        except (KeyError, TypeError, ValueError) as e:
            log.debug("ignoring the saved %s state: %s", kind, e)

    def save(self, policy) -> None:
        """Keep what `policy` learned (after each request; written on the writer's thread)."""
        for kind, state in policy.cost_state().items():
            if kind in self.keys:
                self.store.save_later(self._paths[kind], self.keys[kind], state)

    def save_state(self, kind: str, state: Mapping[str, Any]) -> None:
        """Keep a kind the engine learns beside its policy (ENGINE_KINDS), unless there is nothing."""
        if kind in self.keys and state:
            self.store.save_later(self._paths[kind], self.keys[kind], state)

    def flush(self) -> None:
        """Wait until what was kept is written (an engine's close)."""
        self.store.flush()


class Learner:
    """The engine's learning: the length policy its requests fork (`policy`, which a caller may
    swap: `Engine.using_policy`), where what it learns is kept between processes (`costs`), and
    what the costs every request shares learn from a pass: the draft model's rounds, a verify pass
    several sequences share, and how many sequences lately share a round (`drafting`)."""

    def __init__(self, policy: LengthPolicy, costs: CostBook | None = None) -> None:
        self.policy, self.costs = policy, costs
        self.drafting = 1.0  # sequences a batch's draft rounds are shared by, lately (for its prices)
        self.batch = BatchJudge()  # drafting against plain batched decoding, as measured (several sequences)
        if costs is not None and learns(policy):
            costs.load(policy)
            costs.load_into("batch", self.batch.load_state)

    def save(self, policy: LengthPolicy | None = None) -> None:
        """Write what `policy` (default: the engine's) learned to the cache (after each request)."""
        policy = self.policy if policy is None else policy
        if self.costs is not None and learns(policy):
            self.costs.save(policy)
            self.costs.save_state("batch", self.batch.state())  # nothing where no batch ran

    def decode_time(self, ctx, rows: Sequence[tuple[int, int]], contexts: Mapping[int, int]) -> float | None:
        """Seconds a decode of `rows` (sequence, tokens) on `ctx` would take as the policy learned
        the oracle's passes; None before it measured one, or for a policy that does not learn."""
        if not learns(self.policy):
            return None
        return self.policy.decode_time(passes(ctx, rows, contexts))

    def observe(self, batch, oracle, draft=None) -> None:
        """What the shared costs learn from a step's pass (`step.PassRecord`) beside each step's
        record: every draft decode (a round of one sequence or several, a catch-up on a prompt too:
        what batched drafting costs is known before batches form), and a verify pass shared by
        several sequences, once (a step alone teaches its policy through its record), unless it also
        filled more than SHORT_CHUNK tokens of a prompt (a chunk of hundreds of tokens runs at
        another rate per token; a short one, a prompt's last few tokens, is a verify row's kind)."""
        if batch.running > 1 and batch.drafted is not None:  # how many share a draft's costs, as the next prices expect
            self.drafting = 0.7 * self.drafting + 0.3 * max(1, batch.drafted)
        if not learns(self.policy):
            return
        for held, t in batch.rounds:
            at = {seq: context for seq, _, context in held}
            self.policy.observe_draft_round(passes(draft, [(seq, n) for seq, n, _ in held], at), t)
        if len(batch.rows) > 1 and batch.prefill <= SHORT_CHUNK:
            rows = [(r.seq, len(r.tokens) + r.pad) for r in batch.rows]
            self.policy.observe_pass(passes(oracle, rows, batch.contexts), batch.seconds)

    def observe_batch(self, output) -> None:
        """What a step of several sequences (`step.StepOutput`) measured of drafting against plain
        batched decoding (`batch_judge`): its tokens and seconds, if it filled no prompt."""
        batch = output.batch
        if batch.running < 2 or batch.prefill or not learns(self.policy):
            return
        steps = [r for r in output.results if r.record is not None]
        if not steps:
            return
        drafted = bool(batch.rounds) or any(len(r.tokens) > 1 for r in batch.rows)
        record = steps[0].record  # the step's times, the same in every sequence's record
        self.batch.observe(batch.running, drafted, sum(len(r.tokens) for r in steps),
                           record.draft_time + record.verify_time)


def passes(ctx, rows: Sequence[tuple[int, int]], contexts: Mapping[int, int]) -> list[tuple[list[int], list[int]]]:
    """The passes llama.cpp runs a decode of `rows` (sequence, tokens) on `ctx` as: each one's
    tokens per sequence and contexts, for the cost models."""
    out, consumed = [], dict.fromkeys(contexts, 0)
    for group in ctx.ubatches(rows):
        out.append(([n for _, n in group], [contexts[seq] + consumed[seq] for seq, _ in group]))
        for seq, n in group:
            consumed[seq] += n
    return out
