"""Fast tests of localspec.llama's process-wide parts (no model needed)."""

from __future__ import annotations

import logging
import threading

from localspec import llama


def emit(level: int, text: str) -> None:
    """What llama.cpp does when it logs: calls the callback, maybe with a line in pieces."""
    llama._log_callback(level, text.encode(), None)


def test_captured_log_takes_this_threads_lines_at_its_level_only(caplog):
    other: list[str] = []
    with caplog.at_level(logging.DEBUG, logger="localspec.llama"):
        with llama.captured_log(logging.ERROR) as errors:
            emit(4, "llama_model_load: error loading model: ")
            emit(5, "bad magic\n")  # CONT: the same line, still an error
            emit(2, "llama_model_loader: loaded meta data\n")  # INFO: below the level, logged as usual
            t = threading.Thread(target=lambda: (emit(4, "another thread's error\n"), other.append("done")))
            t.start()
            t.join()
        emit(4, "after the block\n")
    assert errors == ["llama_model_load: error loading model: bad magic"]
    assert other == ["done"]
    levels = {r.getMessage(): r.levelno for r in caplog.records}
    assert levels == {"llama_model_load: error loading model: bad magic": logging.DEBUG,
                      "llama_model_loader: loaded meta data": logging.INFO,
                      "another thread's error": logging.ERROR, "after the block": logging.ERROR}


def test_captured_log_nests_and_restores():
    with llama.captured_log() as outer:
        emit(2, "one\n")
        with llama.captured_log(logging.WARNING) as inner:
            emit(3, "two\n")
            emit(2, "three\n")  # below the inner block's level: not captured by anyone
        emit(2, "four\n")
    assert outer == ["one", "four"] and inner == ["two"]


def test_default_threads_is_the_cpus_this_process_may_use():
    import os

    n = llama.default_threads()
    assert n >= 1
    if hasattr(os, "sched_getaffinity"):
        assert n == len(os.sched_getaffinity(0))
