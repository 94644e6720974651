"""localspec: speculative decoding for local GGUF models on llama.cpp."""

from localspec.options import GenerationOptions
from localspec.outputs import Chunk, Result, Stats

__all__ = ["Engine", "GenerationOptions", "Result", "Stats", "Chunk"]


def __getattr__(name: str):
    if name == "Engine":  # imports llama_cpp: keep `import localspec` light for the pure-numpy parts
        from localspec.runtime.engine import Engine

        return Engine
    raise AttributeError(name)
