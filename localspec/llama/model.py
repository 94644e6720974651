"""A loaded GGUF model: `LlamaModel` owns one `llama_model *` (weights, vocabulary, metadata) and
frees it deterministically (`close()` or a `with` block); `Detokenizer` turns its tokens into text
a token at a time. `check_gguf` is the header check every load starts with."""

from __future__ import annotations

import codecs
import ctypes
import logging
import os
import sys
from pathlib import Path
from typing import Sequence

from localspec.llama.backend import _ensure_backend, captured_log
from localspec.llama.bindings import llama_cpp
from localspec.llama.devices import Device
from localspec.llama.errors import LlamaError, ModelLoadError
from localspec.llama.gguf import GGUF_MAGIC, GgufHeader, remembered_header


def _header_memo() -> Path | None:
    """Where sound GGUF headers are remembered (`llama.gguf.remembered_header`): the cache's
    `gguf-headers.json`; None when the cache directory cannot be made."""
    from localspec.cache import ModelError, cache_dir

    try:
        return cache_dir() / "gguf-headers.json"
    except ModelError:
        return None


def check_gguf(path: Path) -> GgufHeader:
    """Fail early and clearly on what llama.cpp would reject with a vague message (or worse)."""
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelLoadError(f"model path is not a file: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"not a GGUF file (bad magic {magic!r}): {path}")
    header = remembered_header(path, _header_memo())
    if header.problem:
        raise ModelLoadError(f"corrupt or truncated GGUF file ({header.problem}): {path}")
    return header


class _Owner:
    """Owns a llama.cpp handle: `close()` frees it (the contract), a `with` block closes it, and
    garbage collection is the last resort."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if sys.is_finalizing():  # llama.cpp's backend may be gone already; the process's end frees it all
            return
        try:
            self.close()
        except Exception:
            pass


class LlamaModel(_Owner):
    """One loaded GGUF: weights (optionally offloaded to the GPU) and its vocabulary."""

    placement = None  # for a model split over RPC servers: where its layers went (localspec.llama.rpc.Placement)

    def __init__(self, path: str | os.PathLike, *, n_gpu_layers: int = 0, use_mmap: bool = True,
                 devices: Sequence[Device] | None = None, tensor_split: Sequence[float] | None = None) -> None:
        """`devices`: the devices the offloaded layers are split over, in order (None: llama.cpp's
        choice, every local GPU; the CPU is never in the list: it holds what is not offloaded).
        `tensor_split`: each device's share of them (None: by free memory)."""
        _ensure_backend()
        self.path = Path(path)
        self.vocab_digest: bytes | None = check_gguf(self.path).vocab_digest
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers if n_gpu_layers >= 0 else 0x7FFFFFFF  # -1: offload all
        params.use_mmap = use_mmap
        if devices is not None:  # a NULL-terminated ggml_backend_dev_t list, alive while the model loads
            self._devices = (ctypes.c_void_p * (len(devices) + 1))(*(d.handle for d in devices), None)
            params.devices = ctypes.cast(self._devices, ctypes.c_void_p)
        if tensor_split is not None:
            if len(tensor_split) > llama_cpp.llama_max_devices():
                raise ModelLoadError(f"{len(tensor_split)} devices: this llama.cpp handles at most "
                                     f"{llama_cpp.llama_max_devices()}")
            self._tensor_split = (ctypes.c_float * llama_cpp.llama_max_devices())(*tensor_split)
            params.tensor_split = self._tensor_split
        # The CPU "extra buffer types" (AMX / repacked weights) crash llama_decode on Q4_1 on some
        # x86 machines; plain CPU buffers are always correct, and GPU offload is unaffected.
        params.use_extra_bufts = False
        with captured_log(logging.ERROR) as errors:  # a failed load's errors go into the exception
            self._model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            reason = next((e for e in errors if "error loading model" in e), errors[0] if errors else "")
            reason = reason.split("error loading model:", 1)[-1].strip()
            raise ModelLoadError(f"llama.cpp could not load {self.path} (truncated, corrupt or unsupported GGUF"
                                 + (f": {reason})" if reason else ")"))
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab: int = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.vocab_type: int = llama_cpp.llama_vocab_type(self._vocab)
        self.bos: int = llama_cpp.llama_vocab_bos(self._vocab)
        self.eos: int = llama_cpp.llama_vocab_eos(self._vocab)
        self.add_bos: bool = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self.add_eos: bool = bool(llama_cpp.llama_vocab_get_add_eos(self._vocab))
        self.n_params: int = llama_cpp.llama_model_n_params(self._model)
        self.size_bytes: int = llama_cpp.llama_model_size(self._model)
        self.name: str = self.metadata("general.name") or self.path.stem
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}  # asked token by token: a whole vocabulary's worth costs ~20 ms at load

    # -- lifetime
    def close(self) -> None:
        if getattr(self, "_model", None):
            llama_cpp.llama_model_free(self._model)
            self._model = None

    @property
    def handle(self):
        if not self._model:
            raise LlamaError("model is closed")
        return self._model

    # -- metadata
    def metadata(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = llama_cpp.llama_model_meta_val_str(self.handle, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(self.handle, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    @property
    def n_layer(self) -> int:
        """Its repeating layers (the output layer comes after them: offloading n_layer + 1 takes it too)."""
        return llama_cpp.llama_model_n_layer(self.handle)

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache a token takes (F16 keys and values, every layer), from the metadata."""
        m = self.handle
        n_layer, n_embd = llama_cpp.llama_model_n_layer(m), llama_cpp.llama_model_n_embd(m)
        n_head, n_head_kv = max(1, llama_cpp.llama_model_n_head(m)), llama_cpp.llama_model_n_head_kv(m)
        arch = self.metadata("general.architecture") or ""
        key = int(self.metadata(f"{arch}.attention.key_length") or n_embd // n_head)
        value = int(self.metadata(f"{arch}.attention.value_length") or n_embd // n_head)
        return 2 * n_layer * n_head_kv * (key + value)

    @property
    def chat_template(self) -> str | None:
        tmpl = llama_cpp.llama_model_chat_template(self.handle, None)
        return tmpl.decode("utf-8", errors="replace") if tmpl else None

    # -- vocabulary
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (llama_cpp.llama_token * n_max)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
            if n < 0:
                raise LlamaError(f"tokenization failed ({n})")
        return list(buf[:n])

    def token_piece(self, token: int, *, special: bool = False) -> bytes:
        """The bytes of one token (may be part of a UTF-8 character). Control tokens render empty
        unless special=True."""
        key = token if not special else -1 - token
        piece = self._pieces.get(key)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
            piece = buf.raw[:n]
            self._pieces[key] = piece
        return piece

    def token_text(self, token: int) -> bytes:
        """The raw vocabulary entry (as stored in the GGUF), for compatibility checks."""
        text = llama_cpp.llama_vocab_get_text(self._vocab, token)
        return text or b""

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_piece(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        """Whether `token` ends a generation (EOS, EOT, <|im_end|>, ...)."""
        eog = self._eog.get(token)
        if eog is None:
            if not 0 <= token < self.n_vocab:
                raise IndexError(f"token {token} is outside the vocabulary ({self.n_vocab})")
            eog = self._eog[token] = bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))
        return eog


class Detokenizer:
    """Incremental detokenizer: feed tokens, get text that is safe to show (never half a character)."""

    def __init__(self, model: LlamaModel) -> None:
        self._model = model
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        return self._decoder.decode(self._model.token_piece(token))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def model_n_layer(path: str | os.PathLike) -> int:
    """The number of repeating layers (blocks) of a GGUF model, from its metadata alone."""
    _ensure_backend()
    check_gguf(Path(path))
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise ModelLoadError(f"llama.cpp could not read the metadata of {path}")
    try:
        buf = ctypes.create_string_buffer(256)  # hparams are not read with vocab_only: the metadata is
        n = llama_cpp.llama_model_meta_val_str(model, b"general.architecture", buf, len(buf))
        arch = buf.value if n > 0 else b""
        n = llama_cpp.llama_model_meta_val_str(model, arch + b".block_count", buf, len(buf))
        if n <= 0 or not buf.value.isdigit():
            raise ModelLoadError(f"{path} does not say how many layers it has ({arch.decode()}.block_count)")
        return int(buf.value)
    finally:
        llama_cpp.llama_model_free(model)
