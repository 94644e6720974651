"""llama-cpp-python's low-level bindings (`llama_cpp.llama_cpp`, the ctypes functions localspec
calls), loaded without the package's high-level layer.

`import llama_cpp` runs the package's `__init__`, which imports its high-level `Llama` class too,
with its chat formats, grammar and cache modules: ~25 ms of every fresh `localspec generate`
process (measured: median of 10 runs, 0.404 s against 0.433 s), for code localspec never calls. Here the low-level module is imported with the package standing in only
while it loads; the package is then dropped from `sys.modules`, so a later `import llama_cpp` (a
user's, or the bench's llama-cpp-python system) still runs the package's `__init__` in full, and
that finds this same module: one loaded library per process either way.

    from localspec.llama.bindings import llama_cpp   # llama_cpp.llama_decode(...), as with the package
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

PACKAGE = "llama_cpp"
LOW_LEVEL = "llama_cpp.llama_cpp"


def _load() -> ModuleType:
    if PACKAGE in sys.modules or LOW_LEVEL in sys.modules:  # imported already (in full, or by this)
        return importlib.import_module(LOW_LEVEL)
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("llama-cpp-python is not installed (pip install llama-cpp-python)")
    sys.modules[PACKAGE] = importlib.util.module_from_spec(spec)  # its __init__ is not run
    try:
        return importlib.import_module(LOW_LEVEL)
    finally:
        del sys.modules[PACKAGE]


def _version(package_dir: Path) -> str:
    """The package's `__version__`, read from its `__init__.py` (importlib.metadata takes ~30 ms)."""
    try:
        found = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", (package_dir / "__init__.py").read_text(),
                          re.MULTILINE)
    except OSError:
        found = None
    if found:
        return found.group(1)
    import importlib.metadata

    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return "?"


llama_cpp = _load()
PACKAGE_DIR = Path(llama_cpp.__file__).parent  # the installed llama_cpp package (its lib/ holds the libraries)
VERSION = _version(PACKAGE_DIR)  # llama-cpp-python's version, as `llama_cpp.__version__`
