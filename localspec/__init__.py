"""localspec: speculative decoding for local GGUF models on llama.cpp."""

# The one version: the package metadata (pyproject.toml: dynamic, read by setuptools), --version, /openapi.json
# and bench reports all take it from here; CHANGELOG.md's newest release names it.
__version__ = "0.1.0"

from localspec.options import GenerationOptions
from localspec.outputs import Chunk, Result, Stats

__all__ = ["__version__", "Engine", "GenerationOptions", "Result", "Stats", "Chunk"]


def __getattr__(name: str):
    if name == "Engine":  # imports llama_cpp: keep `import localspec` light for the pure-numpy parts
        from localspec.runtime.engine import Engine

        return Engine
    raise AttributeError(name)
