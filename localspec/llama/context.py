"""A small, owning wrapper over llama-cpp-python's low-level API.

`LlamaModel` owns one `llama_model *`, `LlamaContext` owns one `llama_context *` plus one reusable
`llama_batch`, and each frees its handle deterministically (`close()` or a `with` block). The context
is the single owner of its position: `tokens` is exactly what sits in its KV cache, `n_past` is its
length, `decode()` appends and `rollback()` trims with `llama_memory_seq_rm`.

Nothing here knows about speculation; the engine composes two contexts.
"""

from __future__ import annotations

import codecs
import ctypes
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from localspec.batch import Rows  # noqa: F401 (a decode's rows: callers import it from here too)
from localspec.llama.backend import _ensure_backend, captured_log, default_threads, flush_log
from localspec.llama.bindings import PACKAGE_DIR, VERSION, llama_cpp
from localspec.llama.gguf import GGUF_MAGIC, GgufHeader, remembered_header

log = logging.getLogger("localspec.llama.context")

MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ: the most sequences a context holds


class LlamaError(RuntimeError):
    """A llama.cpp call failed."""


class ModelLoadError(LlamaError):
    """A GGUF file could not be loaded (missing, not GGUF, truncated, unsupported)."""


class ContextFullError(LlamaError):
    """The KV cache has no room for the tokens asked to be decoded."""


@dataclass(frozen=True)
class SeqState:
    """One sequence's KV cache in host memory (`LlamaContext.save_seq`): the tokens it holds, at
    positions 0..len-1, and llama.cpp's serialized state of their cells."""

    tokens: tuple[int, ...]
    data: ctypes.Array  # [size] uint8, llama.cpp's own buffer (no copy on the way back)
    size: int

    @property
    def nbytes(self) -> int:
        """Host memory it takes (the state and its tokens)."""
        return self.size + 8 * len(self.tokens)


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


# ---------------------------------------------------------------------------------------------
# model


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
                 devices: Sequence["Device"] | None = None, tensor_split: Sequence[float] | None = None) -> None:
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


# ---------------------------------------------------------------------------------------------
# context


FLASH_ATTN_TYPES = {"auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                    "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED}


def resolve_flash_attn(setting: str, *, n_gpu_layers: int, measured: str | None = None) -> str:
    """"on" or "off" for a context whose model offloads `n_gpu_layers` layers (-1: all).

    "auto" is what is faster for speculation's passes (several tokens, over a growing context):
    the kernel `localspec check` measured faster on this machine if it did (`measured`), else on
    where the layers run on a GPU and off on a CPU. On a CPU, flash attention makes a multi-token
    pass cost more as the context grows (measured on an AVX512 EPYC and on an AVX512+AMX Xeon: a
    9-token F32 pass at 1000-2000 tokens of context costs 15-50% more with it), while llama.cpp's
    own "auto" turns it on wherever the backend supports it."""
    if setting not in FLASH_ATTN_TYPES:
        raise ValueError(f"flash attention must be one of {', '.join(FLASH_ATTN_TYPES)}, got {setting!r}")
    if setting != "auto":
        return setting
    if measured in ("on", "off"):
        return measured
    return "on" if on_local_gpu(n_gpu_layers) else "off"


def on_local_gpu(n_gpu_layers: int) -> bool:
    """Whether a model offloading `n_gpu_layers` layers (-1: all) runs them on a GPU of this
    machine (RPC devices count as a CPU: their kind is unknown here)."""
    return n_gpu_layers != 0 and has_local_gpu()


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest prefix two token sequences share."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the usual case, at C speed
        return n
    return int((np.asarray(a[:n]) != np.asarray(b[:n])).argmax())


class LlamaContext(_Owner):
    """One llama.cpp context over a model, holding up to `n_seq` sequences (llama.cpp sequence ids
    0..n_seq-1), with one reusable batch.

    Invariant: `seq_tokens(s)` is exactly the token sequence sequence s holds in the KV cache, at
    positions 0..len-1. Only `decode`, `decode_rows`, `rollback`, `reset`, `copy_cache_from`,
    `load_seq` and `copy_seq` change it, each passing the sequence id to every llama.cpp memory call; a failed
    decode leaves every sequence as its mirror says. The one-sequence methods (`tokens`, `decode`,
    `sync`, `rollback`, ...) act on sequence 0 unless given `seq`.

    Each sequence has a KV cache of its own of `n_ctx` tokens (llama.cpp's non-unified cache: a
    token's attention reads only its own sequence's cells, where a unified cache would read every
    sequence's), so the cache takes `n_ctx * n_seq` cells in all.
    """

    def __init__(self, model: LlamaModel, *, n_ctx: int = 4096, n_batch: int = 512,
                 n_threads: int | None = None, flash_attn: str = "auto", n_seq: int = 1) -> None:
        """`n_ctx`: tokens each sequence may hold; `flash_attn`: "on", "off" or "auto" (llama.cpp's
        own choice: on wherever the backend supports it, the CPU included); `n_seq`: sequences."""
        self.model = model
        threads = n_threads or default_threads()
        if flash_attn not in FLASH_ATTN_TYPES:
            raise ValueError(f"flash_attn must be one of {', '.join(FLASH_ATTN_TYPES)}, got {flash_attn!r}")
        if not 1 <= n_seq <= MAX_SEQ:
            raise ValueError(f"n_seq must be between 1 and {MAX_SEQ}")
        self.flash_attn = flash_attn
        params = llama_cpp.llama_context_default_params()
        params.flash_attn_type = FLASH_ATTN_TYPES[flash_attn]
        params.n_ctx = n_ctx * n_seq
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = n_seq
        params.kv_unified = False
        params.n_threads = threads
        params.n_threads_batch = threads
        params.no_perf = True
        # backend samplers (sample_greedy) may read every output of a sequence in one decode (a
        # verify pass's k+1 rows), not llama.cpp's default of one; without samplers it changes nothing
        params.n_outputs_max_per_seq = 0
        self._ctx = llama_cpp.llama_init_from_model(model.handle, params)
        flush_log()  # what its backends' own threads logged meanwhile
        if not self._ctx:
            raise LlamaError(f"could not create a context (n_ctx={n_ctx}, {n_seq} sequences) for {model.path.name}")
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self.n_seq = n_seq
        self.n_ctx: int = llama_cpp.llama_n_ctx(self._ctx) // n_seq  # per sequence
        self.n_batch: int = llama_cpp.llama_n_batch(self._ctx)
        self.n_vocab = model.n_vocab
        self._seqs: list[list[int]] = [[] for _ in range(n_seq)]
        # seconds spent inside llama.cpp's decodes, the logits' read included (where a GPU's work is
        # waited for): wall time minus this is the host's own (Stats.host_time)
        self.llama_seconds = 0.0

        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        b = self._batch
        # numpy views over the batch's arrays: filling them is a slice assignment, not a Python loop
        self._b_token = np.ctypeslib.as_array(b.token, shape=(self.n_batch,))
        self._b_pos = np.ctypeslib.as_array(b.pos, shape=(self.n_batch,))
        self._b_logits = np.ctypeslib.as_array(b.logits, shape=(self.n_batch,))
        n_seq_id = np.ctypeslib.as_array(b.n_seq_id, shape=(self.n_batch,))
        n_seq_id[:] = 1
        for i in range(self.n_batch):
            b.seq_id[i][0] = 0
        self._b_seq = np.zeros(self.n_batch, dtype=np.int32)  # what each row's seq_id holds (written on change)
        self._positions = np.arange(self.n_ctx, dtype=np.int32)  # positions 0..n_ctx-1, sliced for a batch
        # sequences whose outputs llama.cpp samples greedily inside the graph (sample_greedy): their
        # chains (kept alive while set), and the last decode's ids of those rows
        self._greedy_chains: dict[int, object] = {}
        self.last_sampled: np.ndarray | None = None  # [n outputs] int32: the backend's id, -1 on host rows

    # -- lifetime
    def close(self) -> None:
        if getattr(self, "_batch", None) is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        for chain in getattr(self, "_greedy_chains", {}).values():  # after the context that used them
            llama_cpp.llama_sampler_free(chain)
        self._greedy_chains = {}

    # -- backend sampling
    def sample_greedy(self, seq: int, on: bool = True) -> bool:
        """Let llama.cpp pick sequence `seq`'s greedy tokens inside its graph (on the GPU where the
        model runs there): a decode then hands back one token id per output row of `seq`
        (`last_sampled`) instead of its logits, none of which cross to the host when no row in the
        decode needs them. `on=False`: its rows' logits again. Returns whether `seq` is now sampled
        on the backend (False where llama.cpp cannot, e.g. a tensor-split model: logits as before).
        Takes effect at the next decode (llama.cpp re-plans its graph once)."""
        if not on:
            if seq in self._greedy_chains:
                llama_cpp.llama_set_sampler(self._ctx, seq, None)
                llama_cpp.llama_sampler_free(self._greedy_chains.pop(seq))
            return False
        if seq in self._greedy_chains:
            return True
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
        if not llama_cpp.llama_set_sampler(self._ctx, seq, chain):
            llama_cpp.llama_set_sampler(self._ctx, seq, None)
            llama_cpp.llama_sampler_free(chain)
            return False
        self._greedy_chains[seq] = chain
        return True

    # -- position
    def seq_tokens(self, seq: int = 0) -> list[int]:
        """What sequence `seq` holds (the mirror itself: do not change it)."""
        return self._seqs[seq]

    @property
    def tokens(self) -> list[int]:
        return self._seqs[0]

    @property
    def n_past(self) -> int:
        return len(self._seqs[0])

    def rollback(self, n_past: int, *, seq: int = 0) -> None:
        """Drop every token of sequence `seq` at position >= n_past."""
        held = self._seqs[seq]
        if n_past >= len(held):
            return
        if not llama_cpp.llama_memory_seq_rm(self._mem, seq, n_past, -1):
            # recurrent/hybrid caches cannot drop a partial suffix: clear it and let the caller re-decode
            llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)
            n_past = 0
        del held[n_past:]

    def reset(self) -> None:
        """Empty every sequence."""
        llama_cpp.llama_memory_clear(self._mem, True)
        for held in self._seqs:
            held.clear()

    def copy_cache_from(self, other: "LlamaContext", *, seq: int = 0, other_seq: int = 0) -> bool:
        """Make sequence `seq` hold what `other`'s sequence `other_seq` holds by copying its KV cache
        (llama.cpp's sequence state) instead of evaluating it: possible when both models lay their
        cache out alike (same architecture and sizes, e.g. a quantized copy of the same model, and
        the same attention kernel); llama.cpp checks that and refuses otherwise. Returns whether it
        was done; on False the sequence is as it was, or empty."""
        state = other.save_seq(other_seq)
        return state is not None and self.load_seq(state, seq=seq)

    def save_seq(self, seq: int = 0) -> "SeqState | None":
        """What sequence `seq` holds, as llama.cpp's sequence state (its KV cells, copied to host
        memory) and the tokens they are: `load_seq` puts it back, in this context or one whose
        model lays its cache out alike. None when the sequence is empty or llama.cpp fails."""
        size = llama_cpp.llama_state_seq_get_size(self._ctx, seq) if self._seqs[seq] else 0
        if not size:
            return None
        buf = (ctypes.c_uint8 * size)()
        got = llama_cpp.llama_state_seq_get_data(self._ctx, buf, size, seq)
        if not got:
            return None
        return SeqState(tuple(self._seqs[seq]), buf, got)

    def load_seq(self, state: "SeqState", *, seq: int = 0) -> bool:
        """Make sequence `seq` hold `state` (from `save_seq`) instead of what it held. Returns
        whether llama.cpp took it; on False the sequence is empty."""
        self._empty(seq)
        with captured_log():  # a refusal is reported by the return value (its log says why, at DEBUG)
            ok = llama_cpp.llama_state_seq_set_data(self._ctx, state.data, state.size, seq)
        if not ok:
            self._empty(seq)
            return False
        self._seqs[seq] = list(state.tokens)
        return True

    def _empty(self, seq: int) -> None:
        llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)
        self._seqs[seq] = []

    def copy_seq(self, src: int, dst: int, n: int) -> bool:
        """Make sequence `dst` hold the first `n` tokens sequence `src` holds, copied in the cache
        (a shared prefix: a system prompt, a conversation's earlier turns), not evaluated again.
        Returns whether it was done (on False `dst` is empty).

        The copy goes through host memory (`save_seq`, `load_seq`), at once. llama.cpp's own
        `llama_memory_seq_cp` between sequences in separate streams only queues a copy of the whole
        stream for the next decode: a state saved or loaded before that decode reads cells that are
        not there yet, or is overwritten by the copy (a request's cache loaded back from the prompt
        cache came out holding another's). It is dearer too on the CPU: 8-20 ms against 3-9 ms for
        270 tokens of SmolLM2-135M, 1024- and 4096-token streams (AMD EPYC, 2 threads)."""
        n = min(n, len(self._seqs[src]))
        state = self.save_seq(src) if n > 0 else None
        if state is None:
            self._empty(dst)
            return n <= 0
        if not self.load_seq(state, seq=dst):  # (it leaves dst empty)
            return False
        self.rollback(n, seq=dst)
        return True

    def common_prefix(self, tokens: Sequence[int], *, seq: int = 0) -> int:
        """Length of the longest prefix `tokens` shares with what sequence `seq` holds."""
        return shared_prefix(self._seqs[seq], tokens)

    # -- evaluation
    def decode(self, tokens: Sequence[int], *, n_logits: int = 1, seq: int = 0) -> np.ndarray:
        """Evaluate `tokens` at sequence `seq`'s next positions and append them to it.

        Logits are computed only for the last `n_logits` tokens. Returns a read-only view
        [n_logits, vocab] into llama.cpp's output buffer, valid until the next decode on this context
        (see `decode_rows` for a sequence sampled on the backend).
        """
        return self.decode_rows([Rows(seq, tokens, n_logits)])

    def decode_rows(self, rows: Sequence[Rows]) -> np.ndarray:
        """Evaluate several sequences' tokens in one batch (one `llama_decode`, or one per `n_batch`
        tokens), each appended to its own sequence. Returns the logits [sum of n_logits, vocab], in
        the order of `rows` (each its last n_logits tokens): a read-only view into llama.cpp's output
        buffer, valid until the next decode, when one llama_decode held them all; else a copy.

        Rows of a sequence sampled on the backend (`sample_greedy`) have their greedy ids in
        `last_sampled` ([sum of n_logits] int32, -1 on the other rows; None when no row is so
        sampled). When every output row is, no logits are read: the result is [sum of n_logits, 0].

        On failure every sequence is left as it was before the call, and ContextFullError (no room
        in a sequence's cache) or LlamaError is raised."""
        if len(rows) == 1 and 0 < len(rows[0].tokens) <= self.n_batch:
            return self._decode_one(rows[0])
        flat_tokens, flat_pos, flat_seq, flat_out = [], [], [], []
        padded: list[tuple[int, int]] = []  # (sequence, where its filler starts)
        n_out = 0
        for r in rows:
            n = len(r.tokens)
            if n == 0:
                continue
            held = self._seqs[r.seq]
            pad = min(r.pad, self.n_ctx - len(held) - n)  # no filler where the sequence has no room
            if len(held) + n > self.n_ctx:
                raise ContextFullError(f"context full: {len(held)} + {n} tokens > n_ctx {self.n_ctx}"
                                       + (f" (sequence {r.seq})" if self.n_seq > 1 else ""))
            k = min(r.n_logits, n)
            start = len(held)
            flat_tokens.append(np.asarray(r.tokens, dtype=np.int32))
            out = np.zeros(n + max(pad, 0), dtype=np.int8)
            out[n - k:n] = 1
            if pad > 0:
                flat_tokens.append(np.full(pad, flat_tokens[-1][-1], dtype=np.int32))
                padded.append((r.seq, start + n))
                n += pad
            flat_pos.append(np.arange(start, start + n, dtype=np.int32))
            flat_seq.append(np.full(n, r.seq, dtype=np.int32))
            flat_out.append(out)
            n_out += k
        if not flat_tokens:
            return np.zeros((0, self.n_vocab), dtype=np.float32)
        tokens = np.concatenate(flat_tokens)
        pos = np.concatenate(flat_pos)
        seqs = np.concatenate(flat_seq)
        outs = np.concatenate(flat_out)
        total = len(tokens)
        starts = {r.seq: len(self._seqs[r.seq]) for r in rows if len(r.tokens)}  # to undo a failure
        pieces: list[np.ndarray] = []
        chunks = range(0, total, self.n_batch)
        backend: list[tuple[int, int]] = []  # (batch row, output index) of the rows sampled on the backend
        if self._greedy_chains:
            out_index = np.cumsum(outs, dtype=np.int64) - 1  # [total]
            backend = [(i, int(out_index[i])) for i in np.flatnonzero(outs).tolist()
                       if int(seqs[i]) in self._greedy_chains]
        sampled = np.full(n_out, -1, dtype=np.int32) if backend else None  # [n_out]
        host_rows = len(backend) < n_out  # some output row needs its logits
        t0 = time.perf_counter()
        try:
            for lo in chunks:
                hi = min(total, lo + self.n_batch)
                m = hi - lo
                self._b_token[:m] = tokens[lo:hi]
                self._b_pos[:m] = pos[lo:hi]
                self._b_logits[:m] = outs[lo:hi]
                self._set_row_seqs(seqs[lo:hi])
                self._batch.n_tokens = m
                rc = llama_cpp.llama_decode(self._ctx, self._batch)
                if rc != 0:
                    if rc == 1:
                        raise ContextFullError(f"no KV cache slot for {m} tokens")
                    raise LlamaError(f"llama_decode failed with code {rc}")
                n_chunk_out = int(outs[lo:hi].sum())
                if sampled is not None:
                    for i, j in backend:  # llama.cpp indexes a decode's rows from 0
                        if lo <= i < hi:
                            sampled[j] = llama_cpp.llama_get_sampled_token_ith(self._ctx, i - lo)
                if n_chunk_out and len(chunks) > 1 and host_rows:  # the next chunk overwrites the buffer
                    pieces.append(self._logits(n_chunk_out).copy())
            if n_out == 0:
                self._wait()  # nothing is read back: the work is waited for here, not in the next decode
        except BaseException:
            for seq, start in starts.items():  # leave every cache exactly as its mirror says
                llama_cpp.llama_memory_seq_rm(self._mem, seq, start, -1)
            raise
        finally:
            self.llama_seconds += time.perf_counter() - t0
        for seq, start in padded:
            llama_cpp.llama_memory_seq_rm(self._mem, seq, start, -1)
        for r in rows:
            if len(r.tokens):
                self._seqs[r.seq].extend(int(t) for t in r.tokens)
        self.last_sampled = sampled
        if n_out == 0:
            return np.zeros((0, self.n_vocab), dtype=np.float32)
        if not host_rows:  # every output was sampled on the backend: llama.cpp copied no logits
            return np.zeros((n_out, 0), dtype=np.float32)
        if len(chunks) > 1:
            out = np.concatenate(pieces)
            out.flags.writeable = False
            return out
        t0 = time.perf_counter()
        logits = self._logits(n_out)  # waits for the device's work, where there is one
        self.llama_seconds += time.perf_counter() - t0
        return logits

    def _decode_one(self, r: Rows) -> np.ndarray:
        """`decode_rows` of one sequence's row that fits one llama_decode (a token of the oracle
        alone, a draft token, a verify pass): the batch filled in place, nothing built per call."""
        held = self._seqs[r.seq]
        n, start = len(r.tokens), len(held)
        if start + n > self.n_ctx:
            raise ContextFullError(f"context full: {start} + {n} tokens > n_ctx {self.n_ctx}"
                                   + (f" (sequence {r.seq})" if self.n_seq > 1 else ""))
        k = min(r.n_logits, n)
        self._b_token[:n] = r.tokens
        self._b_pos[:n] = self._positions[start:start + n]  # start + n <= n_ctx: checked above
        self._b_logits[:n - k] = 0
        self._b_logits[n - k:n] = 1
        if (self._b_seq[:n] != r.seq).any():
            self._set_row_seqs(np.full(n, r.seq, dtype=np.int32))
        self._batch.n_tokens = n
        t0 = time.perf_counter()
        try:
            rc = llama_cpp.llama_decode(self._ctx, self._batch)
            if rc != 0:
                if rc == 1:
                    raise ContextFullError(f"no KV cache slot for {n} tokens")
                raise LlamaError(f"llama_decode failed with code {rc}")
            if r.seq in self._greedy_chains:
                sampled = np.array([llama_cpp.llama_get_sampled_token_ith(self._ctx, i) for i in range(n - k, n)],
                                   dtype=np.int32)  # [k]
                logits = np.zeros((k, 0), dtype=np.float32)
            else:
                sampled = None
                if k:
                    logits = self._logits(k)
                else:
                    self._wait()
                    logits = np.zeros((0, self.n_vocab), dtype=np.float32)
        except BaseException:
            llama_cpp.llama_memory_seq_rm(self._mem, r.seq, start, -1)
            raise
        finally:
            self.llama_seconds += time.perf_counter() - t0
        held.extend(r.tokens.tolist() if isinstance(r.tokens, np.ndarray) else map(int, r.tokens))
        self.last_sampled = sampled
        return logits

    def ubatches(self, rows: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        """How llama.cpp splits a batch of (sequence, tokens) rows, in this order, into the passes it
        runs (ubatches), as [(sequence, tokens)] each. A cache of one sequence per stream (this
        context's) takes, per pass, the same number of tokens from each of a run of consecutive
        sequence ids (llama.cpp's sequential split_equal): rows in sequence order whose token counts
        agree are ONE pass; a sequence with more tokens than the rest, or a gap in the ids, costs
        more passes. With one sequence: passes of up to n_batch tokens."""
        rows = [(seq, n) for seq, n in rows if n > 0]
        if self.n_seq == 1:
            total = sum(n for _, n in rows)
            return [[(seq, min(self.n_batch, total - lo))] for lo in range(0, total, self.n_batch)
                    for seq in (rows[0][0],)] if rows else []
        remaining = [n for _, n in rows]
        out = []
        while any(remaining):
            start = next(i for i, r in enumerate(remaining) if r > 0)
            group = [start]
            for j in range(start + 1, len(rows)):
                if remaining[j] <= 0 or rows[j][0] != rows[group[-1]][0] + 1:
                    break
                group.append(j)
            group = group[:self.n_batch]
            n = max(1, min(min(remaining[i] for i in group), self.n_batch // len(group)))
            out.append([(rows[i][0], n) for i in group])
            for i in group:
                remaining[i] -= n
        return out

    def _wait(self) -> None:
        """Wait for the decodes queued on this context to finish. llama_decode returns before a GPU
        has done the work (a CPU does it first), and reading logits or sampled tokens waits for it:
        a decode whose outputs nobody reads (a prompt's chunk) waits here, so its time is its own
        and not the next decode's (a request's first one-token step had seemed to cost its whole
        prompt on CUDA, which priced the oracle's one-token pass far too high). A no-op on a CPU."""
        llama_cpp.llama_synchronize(self._ctx)

    def _logits(self, n: int) -> np.ndarray:
        ptr = llama_cpp.llama_get_logits(self._ctx)
        view = np.ctypeslib.as_array(ptr, shape=(n, self.n_vocab))
        view.flags.writeable = False
        return view

    def _set_row_seqs(self, seqs: np.ndarray) -> None:
        """Point the batch's first len(seqs) rows at those sequence ids (only the rows that change)."""
        m = len(seqs)
        changed = np.flatnonzero(self._b_seq[:m] != seqs)
        if changed.size:
            b = self._batch
            for i in changed.tolist():
                b.seq_id[i][0] = int(seqs[i])
            self._b_seq[:m] = seqs

    def sync(self, tokens: Sequence[int], *, n_logits: int = 1, seq: int = 0) -> tuple[np.ndarray, int]:
        """Make sequence `seq` hold exactly `tokens`, reusing the longest prefix it holds. Returns the
        logits of the last `n_logits` tokens ([n_logits, vocab]) and how many tokens were evaluated.

        Logits only exist for tokens decoded now, so the last `n_logits` tokens are always evaluated
        (n_logits=0: a pure prefill that may evaluate nothing).
        """
        n_keep = min(self.common_prefix(tokens, seq=seq), len(tokens) - n_logits)
        self.rollback(n_keep, seq=seq)
        todo = tokens[len(self._seqs[seq]):]  # rollback may have cleared more (recurrent caches)
        return self.decode(todo, n_logits=n_logits, seq=seq), len(todo)

    def kv_bytes(self) -> int:
        """The KV cache's size in bytes, every sequence's (F16 keys and values, as llama.cpp's default)."""
        return self.model.kv_bytes_per_token() * self.n_ctx * self.n_seq


# ---------------------------------------------------------------------------------------------
# ggml's devices (local GPUs, RPC servers): llama-cpp-python binds none of ggml's backend registry,
# so the few functions needed are bound here against the ggml libraries llama_cpp has loaded


GGML_DEVICE_KINDS = {0: "CPU", 1: "GPU", 2: "IGPU", 3: "ACCEL", 4: "META"}  # enum ggml_backend_dev_type


class _DevCaps(ctypes.Structure):
    _fields_ = [("async_", ctypes.c_bool), ("host_buffer", ctypes.c_bool), ("buffer_from_host_ptr", ctypes.c_bool),
                ("events", ctypes.c_bool), ("mmap_support", ctypes.c_bool)]


class _DevProps(ctypes.Structure):  # struct ggml_backend_dev_props
    _fields_ = [("name", ctypes.c_char_p), ("description", ctypes.c_char_p), ("memory_free", ctypes.c_size_t),
                ("memory_total", ctypes.c_size_t), ("type", ctypes.c_int), ("device_id", ctypes.c_char_p),
                ("caps", _DevCaps)]


class Ggml:
    """ctypes bindings of ggml's backend and device registry (ggml-backend.h), from the same
    libraries the loaded llama_cpp uses. Get the process's one instance with `ggml()`."""

    def __init__(self) -> None:
        base = Path(getattr(llama_cpp, "_base_path", PACKAGE_DIR / "lib"))
        self._libs = []
        for name in ("ggml", "ggml-base"):  # already loaded by libllama: the same instances
            try:
                self._libs.append(llama_cpp.load_shared_library(name, base))
            except (OSError, RuntimeError) as e:
                log.debug("lib%s not loadable from %s: %s", name, base, e)
        vp, size, text = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
        self.dev_count = self._bind("ggml_backend_dev_count", size)
        self.dev_get = self._bind("ggml_backend_dev_get", vp, size)
        self.dev_name = self._bind("ggml_backend_dev_name", text, vp)
        self.dev_description = self._bind("ggml_backend_dev_description", text, vp)
        self.dev_memory = self._bind("ggml_backend_dev_memory", None, vp, ctypes.POINTER(size), ctypes.POINTER(size))
        self.dev_type = self._bind("ggml_backend_dev_type", ctypes.c_int, vp)
        self.dev_get_props = self._bind("ggml_backend_dev_get_props", None, vp, ctypes.POINTER(_DevProps))
        self.dev_backend_reg = self._bind("ggml_backend_dev_backend_reg", vp, vp)
        self.dev_by_type = self._bind("ggml_backend_dev_by_type", vp, ctypes.c_int)
        self.reg_by_name = self._bind("ggml_backend_reg_by_name", vp, text)
        self.reg_name = self._bind("ggml_backend_reg_name", text, vp)
        self.reg_dev_count = self._bind("ggml_backend_reg_dev_count", size, vp)
        self.reg_dev_get = self._bind("ggml_backend_reg_dev_get", vp, vp, size)
        self.reg_get_proc_address = self._bind("ggml_backend_reg_get_proc_address", vp, vp, text)

    def _bind(self, name: str, restype, *argtypes):
        for lib in self._libs:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.restype, fn.argtypes = restype, list(argtypes)
                return fn
        raise LlamaError(f"llama.cpp's ggml library has no {name} (llama-cpp-python {VERSION})")

    def device(self, handle: int) -> "Device":
        reg = self.dev_backend_reg(handle)
        props = _DevProps()
        self.dev_get_props(handle, ctypes.byref(props))
        return Device(handle=handle, name=(self.dev_name(handle) or b"").decode(errors="replace"),
                      description=(self.dev_description(handle) or b"").decode(errors="replace"),
                      kind=GGML_DEVICE_KINDS.get(self.dev_type(handle), "?"),
                      backend=(self.reg_name(reg) or b"").decode(errors="replace") if reg else "",
                      device_id=props.device_id.decode(errors="replace") if props.device_id else None)

    def memory(self, handle: int) -> tuple[int, int]:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self.dev_memory(handle, ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value


@dataclass(frozen=True)
class Device:
    """One ggml device (a `ggml_backend_dev_t`)."""

    handle: int
    name: str  # CPU, CUDA0, RPC0, ...
    description: str  # for an RPC device: its server's HOST:PORT
    kind: str  # CPU, GPU, IGPU, ACCEL (an RPC device says GPU whatever the server runs)
    backend: str  # the backend registry's name: CPU, CUDA, RPC, ...
    device_id: str | None = None

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes; an RPC device asks its server."""
        return ggml().memory(self.handle)


_ggml: Ggml | None = None
_ggml_lock = threading.Lock()


def ggml() -> Ggml:
    global _ggml
    _ensure_backend()
    with _ggml_lock:
        if _ggml is None:
            _ggml = Ggml()
    return _ggml


def local_devices() -> list[Device]:
    """The devices of this machine llama.cpp knows (RPC servers are added per model, never here)."""
    g = ggml()
    return [g.device(g.dev_get(i)) for i in range(g.dev_count())]


def local_gpus() -> list[Device]:
    """The local GPUs llama.cpp offloads to by default: discrete GPUs (one per device id), integrated
    ones only when there is none (llama_prepare_model_devices)."""
    gpus: list[Device] = []
    igpus: list[Device] = []
    for dev in local_devices():
        if dev.backend == "RPC":
            continue
        if dev.kind == "GPU" and not any(dev.device_id and g.device_id == dev.device_id for g in gpus):
            gpus.append(dev)
        elif dev.kind == "IGPU" and (not igpus or igpus[-1].backend == dev.backend):
            igpus.append(dev)
    return gpus or igpus


def has_local_gpu() -> bool:
    """Whether this machine has a GPU llama.cpp offloads to (llama_supports_gpu_offload() also says
    yes for a CPU-only build with RPC support)."""
    try:
        return bool(local_gpus())
    except LlamaError:
        return bool(llama_cpp.llama_supports_gpu_offload()) and not llama_cpp.llama_supports_rpc()


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
