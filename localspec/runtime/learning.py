"""What the length policy learned, kept between processes: `CostStore` holds fitted pass costs and
acceptance estimates in the cache, one file per key in `<cache>/costs` (`$LOCALSPEC_COST_CACHE`
moves it); the key holds everything that changes the costs (model file, threads, llama.cpp build
and backends, CPU model, attention kernel, GPU offload), so a changed setting starts afresh.
`CostBook` is an engine's: the store and the key of each kind of state (see
`speculative.policy.Learning.cost_state`). The policy's state itself is `speculative.costs`' fit
and `speculative.policy`'s estimates: nothing here is on a step's path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from localspec.cache import cache_dir, write_text_atomically
from localspec.llama.bindings import VERSION, llama_cpp

log = logging.getLogger("localspec.runtime.learning")

# 7: a decode whose outputs nobody read had its GPU time land in the next decode (a request's first
# one-token step seemed to cost its prompt): costs kept before that was fixed are dropped
STATE_VERSION = 7


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
        path = self.path(kind, identity)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomically(path, json.dumps({"version": STATE_VERSION, "identity": dict(identity),
                                                    "state": dict(state)}))
        except OSError as e:
            log.debug("could not save %s: %s", path, e)


class CostBook:
    """Where a length policy's learned state is kept between processes: the store, and the identity
    each kind of state is kept under there (what it depends on: model files, threads, attention
    kernel, machine, ...). See `policy.Learning.cost_state`."""

    def __init__(self, store: CostStore, keys: Mapping[str, Mapping[str, Any]]) -> None:
        self.store = store
        self.keys = {kind: dict(identity) for kind, identity in keys.items()}

    def load(self, policy) -> None:
        """Hand `policy` what earlier processes kept for it; a malformed state is ignored."""
        for kind, identity in self.keys.items():
            state = self.store.load(kind, identity)
            try:
                if state:
                    policy.load_cost_state(kind, state)
            except (KeyError, TypeError, ValueError) as e:
                log.debug("ignoring the saved %s state: %s", kind, e)

    def save(self, policy) -> None:
        """Keep what `policy` learned (after each request)."""
        for kind, state in policy.cost_state().items():
            if kind in self.keys:
                self.store.save(kind, self.keys[kind], state)
