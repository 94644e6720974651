"""The GGUF header check every model load starts with: llama.cpp's own checks are not all there in
every version, and its messages go to the log rather than to the user.

Not llama.cpp's ``gguf`` package: its GGUFReader turns a broken file into an exception too, but it
builds numpy views of every key and tensor, which takes 3-8 s for a SmolLM2 file where this walk
takes 15-60 ms, and its errors ("cannot reshape array ...") do not say what is wrong. A sound
header is remembered per file (`remembered_header`): a fresh process does not walk it again."""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from localspec.cache import write_text_atomically

GGUF_MAGIC = b"GGUF"

# ggml type -> (elements per block, bytes per block), for the tensor data bounds check
_GGML_BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 36),
                10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
                24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 30: (1, 2)}
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


VOCABULARY_KEY = b"tokenizer.ggml.tokens"


@dataclass(frozen=True)
class GgufHeader:
    problem: str | None  # what is wrong with the header; None when it is sound
    # a digest of the vocabulary's token texts as stored (`tokenizer.ggml.tokens`, its type and count
    # included): two models with equal digests have the same token text at every id, which a
    # draft/oracle compatibility check otherwise asks llama.cpp for token by token (~40 ms for 49k)
    vocab_digest: bytes | None = None


def read_gguf_header(path: Path) -> GgufHeader:
    """Walk the GGUF header (version, key-value pairs, tensor infos) and check that every tensor's
    data lies inside the file: llama.cpp's own checks are not all there in every version, and its
    messages go to the log rather than to the user. The same walk digests the vocabulary."""
    size = path.stat().st_size
    if size < 24:
        return GgufHeader("shorter than a GGUF header")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        walk = _Walk(m, size)
        try:
            version = walk.take("I")
            if version not in (2, 3):
                return GgufHeader(f"unsupported version {version}")
            n_tensors, n_kv = walk.take("Q"), walk.take("Q")
            if n_tensors > size // 16 or n_kv > size // 16:
                return GgufHeader(f"implausible counts: {n_tensors} tensors, {n_kv} keys")
            alignment, vocab_digest = walk.keys(n_kv)
            tensors = walk.tensor_infos(n_tensors)
        except (struct.error, ValueError) as e:
            return GgufHeader("the header is cut short" if isinstance(e, struct.error) else str(e))
        data_start = -(-walk.pos // alignment) * alignment
        for n_elements, kind, offset in tensors:
            block, nbytes = _GGML_BLOCKS.get(kind, (1, 0))
            if data_start + offset + n_elements // block * nbytes > size:
                return GgufHeader(f"tensor data ends past the end of the file ({size} bytes)")
    return GgufHeader(None, vocab_digest)


class _Walk:
    """`read_gguf_header`'s position in the mapped file (after the magic) and the reads it makes
    there. What runs past the end raises struct.error (a fixed-size read) or ValueError (a length
    the file cannot hold; also a value no GGUF has), and the header is then broken."""

    def __init__(self, m: mmap.mmap, size: int) -> None:
        self.m, self.size, self.pos = m, size, 4

    def take(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.m, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value[0]

    def string(self) -> bytes:
        n = self.take("Q")
        if n > self.size - self.pos:
            raise ValueError("a string runs past the end of the file")
        self.pos += n
        return self.m[self.pos - n:self.pos]

    def value(self, kind: int, depth: int = 0):
        """A key's value of type `kind`: a scalar's value, a string's bytes; an array is skipped (None)."""
        if kind in _GGUF_SCALARS:
            return self.take(_GGUF_SCALARS[kind])
        if kind == 8:
            return self.string()
        if kind == 9 and depth == 0:
            self._skip_array()
            return None
        raise ValueError(f"unknown value type {kind}")

    def _skip_array(self) -> None:
        item, n = self.take("I"), self.take("Q")
        size = self.size
        if item in _GGUF_SCALARS:
            width = struct.calcsize(_GGUF_SCALARS[item])
            if n * width > size - self.pos:
                raise ValueError("an array runs past the end of the file")
            self.pos += n * width
        elif item == 8:  # strings (a vocabulary: ~50-250k of them): a tight loop, ~10 ms
            if n > size - self.pos:
                raise ValueError("an array runs past the end of the file")
            m, pos, length_at = self.m, self.pos, struct.Struct("<Q").unpack_from
            for _ in range(n):
                if pos + 8 > size:
                    raise ValueError("an array runs past the end of the file")
                pos += 8 + length_at(m, pos)[0]
            self.pos = pos
            if pos > size:
                raise ValueError("a string runs past the end of the file")
        else:
            if n > size - self.pos:
                raise ValueError("an array runs past the end of the file")
            for _ in range(n):
                self.value(item, 1)

    def keys(self, n_kv: int) -> tuple[int, bytes | None]:
        """Walk the `n_kv` key-value pairs: the data's alignment, and the vocabulary's digest."""
        alignment, vocab_digest = 32, None
        for _ in range(n_kv):
            key = self.string()
            start = self.pos
            value = self.value(self.take("I"))
            if key == b"general.alignment" and isinstance(value, int) and value > 0:
                alignment = value
            elif key == VOCABULARY_KEY:
                vocab_digest = hashlib.blake2b(self.m[start:self.pos], digest_size=16).digest()
        return alignment, vocab_digest

    def tensor_infos(self, n_tensors: int) -> list[tuple[int, int, int]]:
        """Walk the `n_tensors` tensor infos: (elements, ggml type, data offset) each."""
        tensors = []
        for _ in range(n_tensors):
            self.string()
            n_dims = self.take("I")
            if n_dims > 8:
                raise ValueError(f"a tensor with {n_dims} dimensions")
            n_elements = 1
            for _ in range(n_dims):
                n_elements *= self.take("Q")
            tensors.append((n_elements, self.take("I"), self.take("Q")))
        return tensors


MEMO_ENTRIES = 64  # files a header memo remembers (the latest checked)
_MEMO_LOCK = threading.Lock()  # an oracle and a draft load at once: one writes the memo at a time


def remembered_header(path: Path, memo: Path | None) -> GgufHeader:
    """`read_gguf_header(path)`, remembered for a sound header in the JSON file `memo` (None: not
    remembered), so that a fresh process does not walk the same file again: ~12-20 ms a SmolLM2
    file, ~35 ms Gemma 3's, and an oracle's and a draft's walks take turns holding the GIL while
    the two load at once. An entry holds while the file keeps its size, mtime and inode; any change
    and the header is walked again. A broken header is never remembered: its error comes every time."""
    resolved = str(path.resolve())
    st = path.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
    entries = _read_memo(memo) if memo is not None else {}
    entry = entries.get(resolved)
    if isinstance(entry, dict) and entry.get("stamp") == stamp:
        digest = entry.get("vocab_digest")
        try:
            return GgufHeader(None, bytes.fromhex(digest) if digest else None)
        except (TypeError, ValueError):
            pass  # a damaged entry: walk the file
    header = read_gguf_header(path)
    if memo is not None and header.problem is None:
        with _MEMO_LOCK:
            entries = _read_memo(memo)  # again: the other model's entry may have come meanwhile
            entries.pop(resolved, None)
            entries[resolved] = {"stamp": stamp,
                                 "vocab_digest": header.vocab_digest.hex() if header.vocab_digest else None}
            _write_memo(memo, dict(list(entries.items())[-MEMO_ENTRIES:]))
    return header


def _read_memo(memo: Path) -> dict:
    try:
        data = json.loads(memo.read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    return data["files"] if isinstance(data, dict) and isinstance(data.get("files"), dict) else {}


def _write_memo(memo: Path, entries: dict) -> None:
    """Atomically; a failure only costs the next walk. Two processes writing at once keep one's
    entries: the other's file is walked again next time."""
    try:
        write_text_atomically(memo, json.dumps({"files": entries}))
    except OSError:
        pass
