"""Test doubles: a scripted random generator for the pure-numpy maths, and a scripted model and
context that stand in for llama.cpp's (`Engine.from_parts` runs the real step loop over them).

A scripted model is a small vocabulary of byte pieces with a greedy longest-match tokenizer. A
scripted context's logits are a deterministic function of the token history (`hashed_logits`: a
generator seeded by a hash of the prefix), so an oracle's and a draft's distributions differ but are
known exactly, and the exact distribution of what the oracle alone would emit can be enumerated.
"""

from __future__ import annotations

import ctypes
import time
import zlib
from typing import Callable, Sequence

import numpy as np

from localspec.llama.context import SeqState


class ScriptedRng:
    """Stands in for np.random.Generator: returns the given uniforms in order, counts the calls."""

    def __init__(self, *us: float):
        self.us = list(us)
        self.calls = 0

    def random(self) -> float:
        self.calls += 1
        return self.us.pop(0)


# ---------------------------------------------------------------- scripted models and contexts

BOS, EOS = 0, 1
BOS_TEXT, EOS_TEXT = b"<s>", b"</s>"

# 40 tokens: BOS, EOS, a-z, three punctuation pieces, the two halves of "\u00e9" and the second half
# of "\u00e8" (pieces that hold part of a UTF-8 character), and six common pairs
BASE_PIECES = ([BOS_TEXT, EOS_TEXT] + [bytes([c]) for c in range(ord("a"), ord("z") + 1)]
               + [b" ", b".", b","] + [b"\xc3", b"\xa9", b"\xa8"] + [b"th", b"he", b"in", b"er", b"an", b"re"])
EXTRA_PIECES = [b"on", b"at", b"en", b"nd", b"es", b"or", b"ti", b"te"]
# another tokenizer over the same text: whole "\u00e9" and "\u00e8", other pairs (a cross-tokenizer draft)
PAIR_PIECES = ([BOS_TEXT, EOS_TEXT] + [bytes([c]) for c in range(ord("a"), ord("z") + 1)]
               + [b" ", b".", b","] + ["\u00e9".encode(), "\u00e8".encode()]
               + [b"t ", b" t", b"e ", b"s ", b" a", b"ca", b"at", b"th", b"it", b"he", b"ou", b"st"])


class ScriptedModel:
    """A vocabulary of byte pieces: ids 0 and 1 are BOS and EOS (control tokens, rendered empty
    unless special=True), the rest are text. The tokenizer takes the longest piece that matches."""

    vocab_type = 2  # BPE, as far as compat.py is concerned
    chat_template = None
    add_bos = True
    add_eos = False

    def __init__(self, pieces: Sequence[bytes], *, name: str = "scripted") -> None:
        assert pieces[BOS] == BOS_TEXT and pieces[EOS] == EOS_TEXT
        self.pieces = list(pieces)
        self.name = name
        self.n_vocab = len(self.pieces)
        self.bos, self.eos = BOS, EOS
        self.vocab_digest = None  # unknown: a compatibility check compares token by token
        self._longest = max(len(p) for p in self.pieces)
        self._ids = {p: i for i, p in enumerate(self.pieces) if i not in (BOS, EOS)}
        self._specials = {BOS_TEXT: BOS, EOS_TEXT: EOS}

    @classmethod
    def sized(cls, n_vocab: int, name: str | None = None) -> "ScriptedModel":
        """The base vocabulary cut or extended to n_vocab tokens (the same token text for shared
        ids, as a family of models whose vocabularies are padded differently)."""
        pieces = (BASE_PIECES + EXTRA_PIECES)[:n_vocab]
        assert len(pieces) == n_vocab
        return cls(pieces, name=name or f"scripted-{n_vocab}")

    def is_eog(self, token: int) -> bool:
        return token == EOS

    @property
    def eog_mask(self) -> np.ndarray:
        mask = np.zeros(self.n_vocab, dtype=bool)
        mask[EOS] = True
        return mask

    def token_piece(self, token: int, *, special: bool = False) -> bytes:
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token {token} is not in {self.name}'s vocabulary of {self.n_vocab}")
        if token in (BOS, EOS) and not special:
            return b""
        return self.pieces[token]

    def token_text(self, token: int) -> bytes:
        return self.pieces[token]

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8")
        out = [BOS] if add_special else []
        i = 0
        while i < len(data):
            if parse_special:
                special = next((s for s in self._specials if data.startswith(s, i)), None)
                if special is not None:
                    out.append(self._specials[special])
                    i += len(special)
                    continue
            for n in range(min(self._longest, len(data) - i), 0, -1):
                token = self._ids.get(data[i:i + n])
                if token is not None:
                    out.append(token)
                    i += n
                    break
            else:
                i += 1  # a byte no piece holds: dropped (a real tokenizer has byte fallbacks)
        return out

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_piece(t) for t in tokens).decode("utf-8", errors="replace")


Logits = Callable[[tuple[int, ...]], np.ndarray]  # token history -> next-token logits [vocab]


def hashed_logits(seed: int, n_vocab: int, *, scale: float = 2.0) -> Logits:
    """Logits [n_vocab] drawn from a generator seeded by (seed, a hash of the history): a fixed,
    known function of the history. Memoised (the same prefixes come back on every request)."""
    memo: dict[tuple[int, ...], np.ndarray] = {}

    def logits(history: tuple[int, ...]) -> np.ndarray:
        row = memo.get(history)
        if row is None:
            key = zlib.crc32(np.asarray(history, dtype=np.int64).tobytes())
            row = (np.random.default_rng([seed, key]).standard_normal(n_vocab) * scale).astype(np.float32)
            row.flags.writeable = False
            memo[history] = row
        return row

    return logits


def related_logits(oracle: Logits, n_oracle: int, seed: int, n_vocab: int, *, weight: float = 0.6,
                   scale: float = 2.0, extra_bias: float = 2.0) -> Logits:
    """A draft's logits over n_vocab tokens that share ids with an oracle of n_oracle tokens:
    weight * the oracle's (cut to n_vocab) + (1 - weight) * its own hashed noise. Ids the oracle does
    not have get the noise plus `extra_bias` (likely enough that a draft would pick them)."""
    noise = hashed_logits(seed, n_vocab, scale=scale)
    memo: dict[tuple[int, ...], np.ndarray] = {}

    def logits(history: tuple[int, ...]) -> np.ndarray:
        row = memo.get(history)
        if row is None:
            row = (1 - weight) * noise(history)  # [n_vocab]
            shared = min(n_vocab, n_oracle)
            row[:shared] += weight * oracle(history)[:shared]
            row[shared:] += extra_bias
            row = row.astype(np.float32)
            row.flags.writeable = False
            memo[history] = row
        return row

    return logits


def copying(logits: Logits, *, bonus: float = 3.0) -> Logits:
    """`logits` plus `bonus` on the token that followed the latest earlier occurrence of the history's
    last token: a model that likes to repeat what it has read (as prompt lookup guesses it will)."""
    memo: dict[tuple[int, ...], np.ndarray] = {}

    def at(history: tuple[int, ...]) -> np.ndarray:
        row = memo.get(history)
        if row is None:
            row = logits(history).copy()
            for i in range(len(history) - 2, -1, -1):
                if history[i] == history[-1]:
                    row[history[i + 1]] += bonus
                    break
            row.flags.writeable = False
            memo[history] = row
        return row

    return at


def favoured(logits: Logits, n_vocab: int, *, seed: int, bonus: float) -> Logits:
    """`logits` plus `bonus` on one token a hash of the history picks (with `seed`): models built on
    the same seed share their favourite at every position, so their argmaxes mostly agree while the
    rest of their distributions need not (a draft accepted far more often greedy than sampled)."""
    memo: dict[tuple[int, ...], np.ndarray] = {}

    def at(history: tuple[int, ...]) -> np.ndarray:
        row = memo.get(history)
        if row is None:
            key = zlib.crc32(np.asarray(history, dtype=np.int64).tobytes())
            row = logits(history).copy()
            row[int(np.random.default_rng([seed, key]).integers(2, n_vocab))] += bonus  # never BOS or EOS
            row.flags.writeable = False
            memo[history] = row
        return row

    return at


class VirtualClock:
    """Stands in for time.perf_counter: time passes only while a `TimedContext` decodes, so what a
    policy measures is exactly the simulated costs."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ScriptedContext:
    """LlamaContext's interface over a scripted model: `seq_tokens(s)` is exactly what sequence s's
    "cache" holds; the logits at each position are `logits(history up to and including that token)`.
    Like llama.cpp, a token id outside the vocabulary is an error (llama_decode refuses the batch)."""

    flash_attn = "off"  # no attention kernel to choose
    n_batch = 512

    def __init__(self, model: ScriptedModel, logits: Logits, *, n_ctx: int = 512, n_seq: int = 1) -> None:
        self.model = model
        self.n_ctx = n_ctx
        self.n_seq = n_seq
        self.n_vocab = model.n_vocab
        self.logits = logits
        self._seqs: list[list[int]] = [[] for _ in range(n_seq)]
        self.n_decoded = 0  # tokens evaluated over the context's life
        self.passes: list[list[tuple[int, int]]] = []  # each decode: (sequence, tokens) of its rows
        self.llama_seconds = 0.0  # seconds in decodes (LlamaContext's: the engine's host time is the rest)

    def seq_tokens(self, seq: int = 0) -> list[int]:
        return self._seqs[seq]

    @property
    def tokens(self) -> list[int]:
        return self._seqs[0]

    @property
    def n_past(self) -> int:
        return len(self._seqs[0])

    @property
    def n_free(self) -> int:
        return self.n_ctx - len(self._seqs[0])

    def rollback(self, n_past: int, *, seq: int = 0) -> None:
        del self._seqs[seq][n_past:]

    def reset(self) -> None:
        for held in self._seqs:
            held.clear()

    def copy_seq(self, src: int, dst: int, n: int) -> bool:
        self._seqs[dst] = list(self._seqs[src][:n])
        return True

    def copy_cache_from(self, other: "ScriptedContext", *, seq: int = 0, other_seq: int = 0) -> bool:
        return False  # scripted caches are not laid out alike: the draft evaluates the text

    def save_seq(self, seq: int = 0) -> SeqState | None:
        """A scripted cache is its tokens: the state carries them and a byte a token."""
        if not self._seqs[seq]:
            return None
        return SeqState(tuple(self._seqs[seq]), (ctypes.c_uint8 * len(self._seqs[seq]))(), len(self._seqs[seq]))

    def load_seq(self, state: SeqState, *, seq: int = 0) -> bool:
        self._seqs[seq] = list(state.tokens)
        return True

    def common_prefix(self, tokens: Sequence[int], *, seq: int = 0) -> int:
        n = 0
        for a, b in zip(self._seqs[seq], tokens):
            if a != b:
                break
            n += 1
        return n

    def ubatches(self, rows):
        rows = [(seq, n) for seq, n in rows if n > 0]
        return [rows] if rows else []  # one pass, whatever it carries

    last_sampled = None  # no backend: every row's logits come back

    def sample_greedy(self, seq: int, on: bool = True) -> bool:
        return False

    def sample_top(self, seq: int, k: int = 0) -> bool:
        return False

    def decode(self, tokens: Sequence[int], *, n_logits: int = 1, seq: int = 0) -> np.ndarray:
        from localspec.llama.context import Rows

        return self.decode_rows([Rows(seq, tokens, n_logits)])

    def decode_rows(self, rows) -> np.ndarray:
        t0 = time.perf_counter()
        try:
            return self._decode(rows)
        finally:
            self.llama_seconds += time.perf_counter() - t0

    def _decode(self, rows) -> np.ndarray:
        from localspec.llama.context import ContextFullError

        for r in rows:
            bad = [t for t in r.tokens if not 0 <= int(t) < self.n_vocab]
            if bad:
                raise ValueError(f"invalid token {bad[0]} for {self.model.name} (vocabulary of {self.n_vocab})")
            if len(self._seqs[r.seq]) + len(r.tokens) > self.n_ctx:
                raise ContextFullError(f"context full: {len(self._seqs[r.seq])} + {len(r.tokens)} tokens > "
                                       f"n_ctx {self.n_ctx}")
        out = []
        for r in rows:
            held = self._seqs[r.seq]
            start = len(held)
            held.extend(int(t) for t in r.tokens)
            self.n_decoded += len(r.tokens)
            n_logits = min(r.n_logits, len(r.tokens))
            out += [self.logits(tuple(held[:start + i + 1])) for i in range(len(r.tokens) - n_logits, len(r.tokens))]
        self.passes.append([(r.seq, len(r.tokens)) for r in rows if len(r.tokens)])
        logits = np.stack(out) if out else np.zeros((0, self.n_vocab), dtype=np.float32)  # [n_logits, vocab]
        logits.flags.writeable = False
        return logits

    def sync(self, tokens: Sequence[int], *, n_logits: int = 1, seq: int = 0) -> tuple[np.ndarray, int]:
        n_keep = min(self.common_prefix(tokens, seq=seq), len(tokens) - n_logits)
        self.rollback(n_keep, seq=seq)
        todo = list(tokens[n_keep:])
        return self.decode(todo, n_logits=n_logits, seq=seq), len(todo)


class TimedContext(ScriptedContext):
    """A scripted context whose every pass takes `fixed + per_token * n` seconds of `clock`."""

    def __init__(self, model: ScriptedModel, logits: Logits, *, clock: VirtualClock, fixed: float,
                 per_token: float, n_ctx: int = 512, n_seq: int = 1) -> None:
        super().__init__(model, logits, n_ctx=n_ctx, n_seq=n_seq)
        self.clock, self.fixed, self.per_token = clock, fixed, per_token

    def decode_rows(self, rows) -> np.ndarray:
        n = sum(len(r.tokens) for r in rows)
        if n:
            self.clock.now += self.fixed + self.per_token * n
            self.llama_seconds += self.fixed + self.per_token * n
        return self._decode(rows)


class CostedContext(ScriptedContext):
    """A scripted context whose every decode takes `cost(tokens in it)` seconds of `clock`: a
    card's cost shape, e.g. a one-token pass much cheaper than a pass of two (a GPU's CUDA graph of
    matrix-vector kernels)."""

    def __init__(self, model: ScriptedModel, logits: Logits, *, clock: VirtualClock, cost: Callable[[int], float],
                 n_ctx: int = 512, n_seq: int = 1) -> None:
        super().__init__(model, logits, n_ctx=n_ctx, n_seq=n_seq)
        self.clock, self.cost = clock, cost

    def decode_rows(self, rows) -> np.ndarray:
        n = sum(len(r.tokens) for r in rows)
        if n:
            self.clock.now += self.cost(n)
            self.llama_seconds += self.cost(n)
        return self._decode(rows)
