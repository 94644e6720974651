"""A small, owning wrapper over llama-cpp-python's low-level API: the context.

`LlamaContext` owns one `llama_context *` plus one reusable `llama_batch`, and frees them
deterministically (`close()` or a `with` block); `LlamaModel` (llama/model.py) owns the model it runs.
The context is the single owner of its position: `seq_tokens(s)` is exactly what sequence s holds
in its KV cache, `decode()` appends and `rollback()` trims with `llama_memory_seq_rm`.

Nothing here knows about speculation; the engine composes two contexts.

The model, its errors and ggml's devices live in modules of their own; what callers have always
imported from here still is (`from localspec.llama.context import LlamaModel, ...`).
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from localspec.batch import Rows, TopRow  # noqa: F401 (a decode's rows: callers import them from here too)
from localspec.llama.backend import captured_log, default_threads, flush_log
from localspec.llama.bindings import llama_cpp
from localspec.llama.devices import on_local_gpu
from localspec.llama.errors import ContextFullError, LlamaError
from localspec.llama.model import LlamaModel, _Owner
from localspec.llama.picks import GREEDY, Picks

# what callers import from here, though it lives in llama/devices.py, errors.py and model.py
from localspec.llama.devices import Device, ggml, has_local_gpu, local_devices, local_gpus  # noqa: F401
from localspec.llama.errors import ModelLoadError  # noqa: F401
from localspec.llama.model import Detokenizer, check_gguf, model_n_layer  # noqa: F401

MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ: the most sequences a context holds


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



def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest prefix two token sequences share."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the usual case, at C speed
        return n
    return int((np.asarray(a[:n]) != np.asarray(b[:n])).argmax())


@dataclass(frozen=True)
class _FlatRows:
    """A decode's rows laid end to end as batch rows (`LlamaContext._flatten`): per batch row its
    token, position, sequence id and whether its logits are asked for."""

    tokens: np.ndarray  # [total] int32: each row's tokens, then its filler
    pos: np.ndarray  # [total] int32
    seqs: np.ndarray  # [total] int32
    outs: np.ndarray  # [total] int8: 1 on an output row
    padded: list[tuple[int, int]]  # (sequence, where its filler starts): dropped again once decoded
    n_out: int  # output rows
    backend: list[tuple[int, int]]  # (batch row, output index) of the rows picked greedily on the backend
    top: list[tuple[int, int]]  # ... and of the rows whose top k the backend keeps (`TopRow`)

    @property
    def host_rows(self) -> bool:
        """Whether some output row needs its logits (is not picked for on the backend)."""
        return len(self.backend) + len(self.top) < self.n_out


class LlamaContext(_Owner):
    """One llama.cpp context over a model, holding up to `n_seq` sequences (llama.cpp sequence ids
    0..n_seq-1), with one reusable batch.

    Invariant: `seq_tokens(s)` is exactly the token sequence sequence s holds in the KV cache, at
    positions 0..len-1. Only `decode`, `decode_rows`, `rollback`, `reset`, `copy_cache_from`,
    `load_seq` and `copy_seq` change it, each passing the sequence id to every llama.cpp memory call; a failed
    decode leaves every sequence as its mirror says. The one-sequence methods (`seq_tokens`, `decode`,
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
        # sequences whose outputs llama.cpp picks for inside the graph (sample_greedy, sample_top),
        # and the last decode's greedy ids of those rows
        self._picks = Picks(self._ctx)
        self.last_sampled: np.ndarray | None = None  # [n outputs] int32: the backend's id, -1 on host rows

    # -- lifetime
    def close(self) -> None:
        if getattr(self, "_batch", None) is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_picks", None) is not None:  # after the context that used its chains
            self._picks.close()

    # -- backend sampling
    def sample_greedy(self, seq: int, on: bool = True) -> bool:
        """Let llama.cpp pick sequence `seq`'s greedy tokens inside its graph (on the GPU where the
        model runs there): a decode then hands back one token id per output row of `seq`
        (`last_sampled`) instead of its logits, none of which cross to the host when no row in the
        decode needs them. `on=False`: its rows' logits again. Returns whether `seq` is now sampled
        on the backend (False where llama.cpp cannot, e.g. a tensor-split model: logits as before).
        Takes effect at the next decode (llama.cpp re-plans its graph once)."""
        return self._picks.set(seq, GREEDY if on else None)

    def sample_top(self, seq: int, k: int = 0) -> bool:
        """Let llama.cpp keep the `k` largest logits of each of sequence `seq`'s output rows inside
        its graph (a draft model's rows, on the GPU where it runs there): a decode then hands back
        a `TopRow` for each of them (its k logits and their ids) in place of the row, and none of
        those rows' logits cross to the host. k=0: whole rows again. Returns whether `seq` is now
        so picked for (False where llama.cpp cannot). Takes effect at the next decode."""
        return self._picks.set(seq, int(k) if k > 0 else None)

    # -- position
    def seq_tokens(self, seq: int = 0) -> list[int]:
        """What sequence `seq` holds (the mirror itself: do not change it)."""
        return self._seqs[seq]

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

    def decode_rows(self, rows: Sequence[Rows]) -> np.ndarray | list:
        """Evaluate several sequences' tokens in one batch (one `llama_decode`, or one per `n_batch`
        tokens), each appended to its own sequence. Returns the logits [sum of n_logits, vocab], in
        the order of `rows` (each its last n_logits tokens): a read-only view into llama.cpp's output
        buffer, valid until the next decode, when one llama_decode held them all; else a copy.

        Rows of a sequence sampled on the backend (`sample_greedy`) have their greedy ids in
        `last_sampled` ([sum of n_logits] int32, -1 on the other rows; None when no row is so
        sampled). When every output row is, no logits are read: the result is [sum of n_logits, 0].
        Where a row's sequence has its top k kept on the backend (`sample_top`), the result is a
        list of the output rows instead, each such row a `TopRow`, the others their logits.

        On failure every sequence is left as it was before the call, and ContextFullError (no room
        in a sequence's cache) or LlamaError is raised."""
        if len(rows) == 1 and 0 < len(rows[0].tokens) <= self.n_batch:
            return self._decode_one(rows[0])
        flat = self._flatten(rows)
        if flat is None:
            return np.zeros((0, self.n_vocab), dtype=np.float32)
        starts = {r.seq: len(self._seqs[r.seq]) for r in rows if len(r.tokens)}  # to undo a failure
        sampled, tops, pieces = self._decode_flat(flat, starts)
        for seq, start in flat.padded:
            llama_cpp.llama_memory_seq_rm(self._mem, seq, start, -1)
        for r in rows:
            if len(r.tokens):
                self._seqs[r.seq].extend(int(t) for t in r.tokens)
        self.last_sampled = sampled
        logits = self._flat_logits(flat, pieces)
        if not tops:
            return logits
        return [tops[j] if j in tops else logits[j] for j in range(flat.n_out)]  # each output row

    def _flatten(self, rows: Sequence[Rows]) -> _FlatRows | None:
        """`rows` laid end to end as batch rows, each after what its sequence holds (None: no
        tokens at all). ContextFullError where a sequence has no room for its row."""
        flat_tokens, flat_pos, flat_seq, flat_out = [], [], [], []
        padded: list[tuple[int, int]] = []  # (sequence, where its filler starts)
        n_out = 0
        for r in rows:
            n = len(r.tokens)
            if n == 0:
                continue
            self._check_room(r.seq, n)
            start = len(self._seqs[r.seq])
            pad = min(r.pad, self.n_ctx - start - n)  # no filler where the sequence has no room
            k = min(r.n_logits, n)
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
            return None
        seqs, outs = np.concatenate(flat_seq), np.concatenate(flat_out)
        backend: list[tuple[int, int]] = []
        top: list[tuple[int, int]] = []
        if self._picks:
            out_index = np.cumsum(outs, dtype=np.int64) - 1  # [total]
            for i in np.flatnonzero(outs).tolist():
                seq = int(seqs[i])
                if self._picks.greedy(seq):
                    backend.append((i, int(out_index[i])))
                elif self._picks.top(seq):
                    top.append((i, int(out_index[i])))
        return _FlatRows(np.concatenate(flat_tokens), np.concatenate(flat_pos), seqs, outs, padded, n_out, backend, top)

    def _decode_flat(self, flat: _FlatRows, starts: dict[int, int]
                     ) -> tuple[np.ndarray | None, dict[int, TopRow], list[np.ndarray]]:
        """Run `flat` through llama_decode, `n_batch` rows a pass. Returns the ids sampled on the
        backend ([n_out], None where no row is), the top rows the backend kept (by output index)
        and, where it took more than one pass and some output needs its logits, a copy of each
        pass's logits (the next pass overwrites llama.cpp's buffer). On failure each sequence is
        trimmed back to `starts` (where it started) before raising."""
        total = len(flat.tokens)
        chunks = range(0, total, self.n_batch)
        pieces: list[np.ndarray] = []
        sampled = np.full(flat.n_out, -1, dtype=np.int32) if flat.backend else None  # [n_out]
        tops: dict[int, TopRow] = {}
        t0 = time.perf_counter()
        try:
            for lo in chunks:
                hi = min(total, lo + self.n_batch)
                m = hi - lo
                self._b_token[:m] = flat.tokens[lo:hi]
                self._b_pos[:m] = flat.pos[lo:hi]
                self._b_logits[:m] = flat.outs[lo:hi]
                self._set_row_seqs(flat.seqs[lo:hi])
                self._run_batch(m)
                n_chunk_out = int(flat.outs[lo:hi].sum())
                if sampled is not None:
                    for i, j in flat.backend:  # llama.cpp indexes a decode's rows from 0
                        if lo <= i < hi:
                            sampled[j] = self._picks.sampled_id(i - lo)
                for i, j in flat.top:
                    if lo <= i < hi:
                        tops[j] = self._picks.top_row(i - lo)
                if n_chunk_out and len(chunks) > 1 and flat.host_rows:  # the next chunk overwrites the buffer
                    pieces.append(self._logits(n_chunk_out).copy())
            if flat.n_out == 0:
                self._wait()  # nothing is read back: the work is waited for here, not in the next decode
        except BaseException:
            for seq, start in starts.items():  # leave every cache exactly as its mirror says
                llama_cpp.llama_memory_seq_rm(self._mem, seq, start, -1)
            raise
        finally:
            self.llama_seconds += time.perf_counter() - t0
        return sampled, tops, pieces

    def _flat_logits(self, flat: _FlatRows, pieces: list[np.ndarray]) -> np.ndarray:
        """`decode_rows`' result once `flat` is decoded: its outputs' logits ([n_out, vocab]), or
        [n_out, 0] where every one was sampled on the backend."""
        if flat.n_out == 0:
            return np.zeros((0, self.n_vocab), dtype=np.float32)
        if not flat.host_rows:  # every output was sampled on the backend: llama.cpp copied no logits
            return np.zeros((flat.n_out, 0), dtype=np.float32)
        if pieces:  # more than one pass: each one's logits were copied before the next
            out = np.concatenate(pieces)
            out.flags.writeable = False
            return out
        t0 = time.perf_counter()
        logits = self._logits(flat.n_out)  # waits for the device's work, where there is one
        self.llama_seconds += time.perf_counter() - t0
        return logits

    def _decode_one(self, r: Rows) -> np.ndarray | list[TopRow]:
        """`decode_rows` of one sequence's row that fits one llama_decode (a token of the oracle
        alone, a draft token, a verify pass): the batch filled in place, nothing built per call."""
        held = self._seqs[r.seq]
        n, start = len(r.tokens), len(held)
        self._check_room(r.seq, n)
        k = min(r.n_logits, n)
        self._b_token[:n] = r.tokens
        self._b_pos[:n] = self._positions[start:start + n]  # start + n <= n_ctx: checked above
        self._b_logits[:n - k] = 0
        self._b_logits[n - k:n] = 1
        if (self._b_seq[:n] != r.seq).any():
            self._set_row_seqs(np.full(n, r.seq, dtype=np.int32))
        t0 = time.perf_counter()
        try:
            self._run_batch(n)
            if self._picks.greedy(r.seq) and k:
                sampled = np.array([self._picks.sampled_id(i) for i in range(n - k, n)], dtype=np.int32)  # [k]
                logits = np.zeros((k, 0), dtype=np.float32)
            elif self._picks.top(r.seq) and k:
                sampled = None
                logits = [self._picks.top_row(i) for i in range(n - k, n)]  # k TopRows
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

    def _check_room(self, seq: int, n: int) -> None:
        """ContextFullError unless sequence `seq` has room for `n` more tokens."""
        held = len(self._seqs[seq])
        if held + n > self.n_ctx:
            raise ContextFullError(f"context full: {held} + {n} tokens > n_ctx {self.n_ctx}"
                                   + (f" (sequence {seq})" if self.n_seq > 1 else ""))

    def _run_batch(self, m: int) -> None:
        """llama_decode the batch's first `m` rows (filled already)."""
        self._batch.n_tokens = m
        rc = llama_cpp.llama_decode(self._ctx, self._batch)
        if rc != 0:
            if rc == 1:
                raise ContextFullError(f"no KV cache slot for {m} tokens")
            raise LlamaError(f"llama_decode failed with code {rc}")

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

