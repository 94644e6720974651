"""Process-wide llama.cpp set-up: the backend initialised once, llama.cpp's log routed to Python
logging (and captured by a thread while it asks, `captured_log`), the threads a process may use.

Its own module so that what loads models (llama/model.py, context.py) and what derives them
(models/derive.py) both depend on it, not on each other.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import threading
from typing import Iterator

from localspec.llama.bindings import llama_cpp

log = logging.getLogger("localspec.llama.context")

_init_lock = threading.Lock()
_initialised = False

# ggml_log_level: 1 DEBUG, 2 INFO, 3 WARN, 4 ERROR, 5 CONT (continues the previous line)
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
# llama.cpp logs from the thread that called it, in pieces: each thread assembles its own lines, and
# a thread may capture its own lines for a while (a model load its errors, the quantizer everything)
_log_state = threading.local()
# what threads Python did not start log (a GPU backend's or a loader's own workers): kept as it came,
# (thread, level, bytes), and logged later by a Python thread (`flush_log`). On such a thread the
# callback runs in a thread state made for the call alone: Python's logging there (a record asks
# for the current thread, a handler takes its locks, pytest's caplog formats) is what the GPU check's
# load under DEBUG logging crashed in (segmentation fault in llama_model_load_from_file), so it does
# nothing there but append
_foreign: collections.deque[tuple[int, int, bytes]] = collections.deque()
_foreign_lines: dict[int, tuple[int, list[str]]] = {}  # a foreign thread's line so far: (level, pieces)


def _thread_log_state():
    state = _log_state
    if not hasattr(state, "buffer"):
        state.buffer, state.level, state.capture = [], logging.DEBUG, None
    return state


def _python_thread() -> bool:
    """Whether the calling thread is one Python started (or the main thread); asks without making
    a `threading._DummyThread` for a foreign one, as `threading.current_thread()` would."""
    return threading.get_ident() in threading._active  # type: ignore[attr-defined]


@llama_cpp.llama_log_callback
def _log_callback(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    if not _python_thread():
        _foreign.append((threading.get_ident(), level, text or b""))
        return
    if _foreign:
        flush_log()
    _log_piece(level, text or b"")


def _log_piece(level: int, text: bytes) -> None:
    state = _thread_log_state()
    if level != 5:  # 5 (CONT) continues the previous line
        state.level = _LEVELS.get(level, logging.DEBUG)
    state.buffer.append(text.decode("utf-8", errors="replace"))
    if state.buffer[-1].endswith("\n"):
        line = "".join(state.buffer).rstrip()
        state.buffer.clear()
        if line:
            if state.capture is not None and state.level >= state.capture[1]:
                state.capture[0].append(line)  # captured (see captured_log): the log has it at DEBUG only
                log.debug("%s", line)
            else:
                log.log(state.level, "%s", line)


def flush_log() -> None:
    """Log what threads Python did not start logged since the last flush (see `_foreign`): called
    by the next line a Python thread logs, and after each model load and context creation."""
    while _foreign:
        try:
            thread, level, text = _foreign.popleft()
        except IndexError:  # another Python thread flushed it first
            return
        pending = _foreign_lines.get(thread)
        if level != 5 or pending is None:  # 5 (CONT) continues the previous line
            pending = _foreign_lines[thread] = (_LEVELS.get(level, logging.DEBUG), [])
        pending[1].append(text.decode("utf-8", errors="replace"))
        if pending[1][-1].endswith("\n"):
            del _foreign_lines[thread]
            line = "".join(pending[1]).rstrip()
            if line:
                log.log(pending[0], "%s", line)


def _ensure_backend() -> None:
    global _initialised
    with _init_lock:
        # every time: importing llama-cpp-python's whole package (its high-level layer) later sets
        # its own callback, which prints llama.cpp's log to stderr
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
        if not _initialised:
            llama_cpp.llama_backend_init()
            _initialised = True


@contextlib.contextmanager
def captured_log(level: int = logging.DEBUG) -> Iterator[list[str]]:
    """Collect the lines llama.cpp logs from this thread at `level` or above while the block runs
    (into the list it yields) rather than logging them at their own level: a failed model load
    puts its errors in the exception, the quantizer's line per tensor stays off the terminal.
    Other threads' lines are not affected."""
    _ensure_backend()
    state = _thread_log_state()
    outer, lines = state.capture, []
    state.capture = (lines, level)
    try:
        yield lines
    finally:
        state.capture = outer
        flush_log()



def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS
        return max(1, os.cpu_count() or 1)
