"""Derived models: a GGUF made locally from another one with llama.cpp's quantizer."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
from pathlib import Path
from typing import Iterator

from .cache import ModelError, Progress, say, sha256_file, temp_beside

# ftype names accepted in models.toml -> llama_cpp constant.  Types that need an importance matrix
# (IQ1_*, IQ2_*, IQ3_XXS) are left out: the registry has no imatrix to give the quantizer.
FTYPES: dict[str, str] = {
    "F32": "LLAMA_FTYPE_ALL_F32",
    **{
        name: "LLAMA_FTYPE_MOSTLY_" + name
        for name in (
            "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
            "Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M",
            "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0",
        )
    },
}


@contextlib.contextmanager
def _capture_llama_log(llama_cpp, lines: list[str]) -> Iterator[None]:
    """Collect llama.cpp's log lines (the quantizer logs every tensor) instead of printing them,
    then put back whatever log callback was installed before."""
    if not hasattr(llama_cpp, "llama_log_get"):  # older bindings: just turn llama-cpp-python's printing down
        logger = logging.getLogger("llama-cpp-python")
        old_level = logger.level
        logger.setLevel(logging.CRITICAL)
        try:
            yield
        finally:
            logger.setLevel(old_level)
        return
    old_cb, old_data = llama_cpp.llama_log_callback(), ctypes.c_void_p()
    llama_cpp.llama_log_get(ctypes.byref(old_cb), ctypes.byref(old_data))
    pieces: list[str] = []

    @llama_cpp.llama_log_callback
    def collect(level, text, user_data):  # lines arrive in pieces
        pieces.append(text.decode("utf-8", "replace"))
        if pieces[-1].endswith("\n"):
            lines.append("".join(pieces).rstrip())
            pieces.clear()

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        yield
    finally:
        llama_cpp.llama_log_set(old_cb, old_data)


def derive_gguf(src: Path, dest: Path, ftype: str, *, label: str | None = None, progress: Progress | None = None) -> str:
    """Quantize (or dequantize) ``src`` to ``ftype`` with llama.cpp into ``dest`` (atomically).

    Returns the sha256 of the result.
    """
    dest = Path(dest)
    label = label or dest.name
    if ftype not in FTYPES:
        raise ModelError(f"{label}: unknown ftype {ftype!r} (known: {', '.join(FTYPES)})")
    try:
        import llama_cpp
    except ImportError as e:
        raise ModelError(f"deriving {label} needs llama-cpp-python: {e}") from None
    value = getattr(llama_cpp, FTYPES[ftype], None)
    if value is None:
        raise ModelError(f"{label}: this llama-cpp-python has no {FTYPES[ftype]}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = value
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    tmp = temp_beside(dest)
    log: list[str] = []
    try:
        with _capture_llama_log(llama_cpp, log):
            rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(tmp), ctypes.byref(params))
        if rc != 0:
            errors = [l for l in log if re.search(r"error|failed|exception", l, re.I)] or log or ["no log"]
            raise ModelError(f"{label}: llama.cpp could not quantize {src} to {ftype}: {errors[-1].strip()}")
        for line in log:
            if "WARNING: " in line:  # e.g. "180 of 272 tensor(s) required fallback quantization"
                say(progress, f"  {label}: llama.cpp: {line.split('WARNING: ', 1)[1]}")
        with open(tmp, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelError(f"{label}: llama.cpp quantize wrote something that is not a GGUF file")
        actual = sha256_file(tmp)
        os.replace(tmp, dest)
        return actual
    finally:
        tmp.unlink(missing_ok=True)
