"""What the llama.cpp layer raises: `LlamaError` and the failures a caller tells apart."""

class LlamaError(RuntimeError):
    """A llama.cpp call failed."""


class ModelLoadError(LlamaError):
    """A GGUF file could not be loaded (missing, not GGUF, truncated, unsupported)."""


class ContextFullError(LlamaError):
    """The KV cache has no room for the tokens asked to be decoded."""
