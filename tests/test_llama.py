"""Fast tests of localspec.llama.backend's process-wide parts and of what localspec.llama.context computes
without a model."""

from __future__ import annotations

import logging
import threading

from localspec.llama import backend
from localspec.llama import context as llama


def emit(level: int, text: str) -> None:
    """What llama.cpp does when it logs: calls the callback, maybe with a line in pieces."""
    backend._log_callback(level, text.encode(), None)


def test_captured_log_takes_this_threads_lines_at_its_level_only(caplog):
    other: list[str] = []
    with caplog.at_level(logging.DEBUG, logger="localspec.llama.context"):
        with backend.captured_log(logging.ERROR) as errors:
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
    with backend.captured_log() as outer:
        emit(2, "one\n")
        with backend.captured_log(logging.WARNING) as inner:
            emit(3, "two\n")
            emit(2, "three\n")  # below the inner block's level: not captured by anyone
        emit(2, "four\n")
    assert outer == ["one", "four"] and inner == ["two"]


def test_default_threads_is_the_cpus_this_process_may_use():
    import os

    n = backend.default_threads()
    assert n >= 1
    if hasattr(os, "sched_getaffinity"):
        assert n == len(os.sched_getaffinity(0))


def test_bindings_load_without_the_high_level_layer_and_leave_the_package_whole():
    """localspec loads llama_cpp's low-level module alone (the package's __init__ would import its
    high-level Llama, chat formats and jinja2 too); a later `import llama_cpp` still gets the whole
    package, over the same loaded module."""
    import subprocess
    import sys

    code = (
        "import sys, importlib.metadata\n"
        "import localspec.llama.context, localspec.llama.rpc\n"
        "from localspec.llama.bindings import VERSION, llama_cpp as low\n"
        "assert 'llama_cpp.llama' not in sys.modules, 'the high-level layer was imported'\n"
        "assert 'llama_cpp' not in sys.modules\n"
        "assert VERSION == importlib.metadata.version('llama-cpp-python'), VERSION\n"
        "import llama_cpp\n"
        "assert llama_cpp.Llama and llama_cpp.__version__ == VERSION\n"
        "assert llama_cpp.llama_decode is low.llama_decode and llama_cpp.llama_cpp is low\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_batch_runs_as_the_passes_llama_cpp_splits_it_into():
    """A cache of a stream per sequence: one pass for consecutive sequences of as many tokens each;
    a sequence with more, or a gap in the ids, costs more passes (llama.cpp's sequential split)."""
    from types import SimpleNamespace

    ubatches = llama.LlamaContext.ubatches
    ctx = SimpleNamespace(n_seq=8, n_batch=512)
    assert ubatches(ctx, [(0, 1), (1, 1), (2, 1), (3, 1)]) == [[(0, 1), (1, 1), (2, 1), (3, 1)]]
    assert ubatches(ctx, [(0, 3), (1, 3)]) == [[(0, 3), (1, 3)]]
    assert ubatches(ctx, [(0, 1), (1, 6), (2, 3), (3, 1)]) == [[(0, 1), (1, 1), (2, 1), (3, 1)], [(1, 2), (2, 2)],
                                                               [(1, 3)]]
    assert ubatches(ctx, [(0, 1), (2, 1), (3, 1)]) == [[(0, 1)], [(2, 1), (3, 1)]]  # a gap at 1
    assert ubatches(SimpleNamespace(n_seq=1, n_batch=512), [(0, 700)]) == [[(0, 512)], [(0, 188)]]


def test_a_thread_python_did_not_start_logs_nothing_until_a_python_thread_flushes_it(caplog):
    """llama.cpp may log from threads of its own (a GPU backend's, a loader's workers): there the
    callback only keeps the pieces (Python's logging on such a thread is where a CUDA load under
    DEBUG logging crashed); the next Python-thread line or `flush_log` logs them, whole lines."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    seen_during: list[int] = []

    @ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
    def foreign(_arg):  # runs on a thread pthread_create made, unknown to threading
        emit(3, "ggml_cuda_init: found ")
        emit(5, "1 CUDA devices\n")
        seen_during.append(len(caplog.records))
        return None

    with caplog.at_level(logging.DEBUG, logger="localspec.llama.context"):
        tid = ctypes.c_ulong()
        assert libc.pthread_create(ctypes.byref(tid), None, foreign, None) == 0
        assert libc.pthread_join(tid, None) == 0
        assert seen_during == [0] and not caplog.records  # kept, not logged, on that thread
        emit(2, "llama_model_loader: loaded meta data\n")  # a Python thread's line flushes first
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "ggml_cuda_init: found 1 CUDA devices"),
        (logging.INFO, "llama_model_loader: loaded meta data")]
    backend.flush_log()  # nothing left
