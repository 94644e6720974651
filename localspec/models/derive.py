"""Derived models: a GGUF made locally from another one with llama.cpp's quantizer."""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

from localspec.cache import ModelError, Progress, say, sha256_file, temp_beside

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


def derive_gguf(src: Path, dest: Path, ftype: str, *, label: str | None = None, progress: Progress | None = None) -> str:
    """Quantize (or dequantize) ``src`` to ``ftype`` with llama.cpp into ``dest`` (atomically).

    Returns the sha256 of the result.
    """
    dest = Path(dest)
    label = label or dest.name
    if ftype not in FTYPES:
        raise ModelError(f"{label}: unknown ftype {ftype!r} (known: {', '.join(FTYPES)})")
    try:
        from localspec.llama.bindings import llama_cpp

        from localspec.llama.backend import captured_log, default_threads
    except ImportError as e:
        raise ModelError(f"deriving {label} needs llama-cpp-python: {e}") from None
    value = getattr(llama_cpp, FTYPES[ftype], None)
    if value is None:
        raise ModelError(f"{label}: this llama-cpp-python has no {FTYPES[ftype]}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = value
    params.allow_requantize = True
    params.nthread = default_threads()
    tmp = temp_beside(dest)
    try:
        with captured_log() as log:  # the quantizer logs every tensor: keep it from the user's terminal
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
