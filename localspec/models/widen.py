"""A widened benchmarking oracle: a llama-architecture GGUF zero-padded to a bigger model's shapes.

The machines this project borrows for GPU checks have no network, so the only models that reach
them are the SmolLM2 files; on a GPU that 135M oracle is as cheap as its draft, and cannot show what
speculation is for. Padded with zeros, the same model takes an 8B model's shapes, and with them its
cost (every pass reads and multiplies all of its weights), while it computes the same function:

- the embedding (and an untied output matrix) gets zero columns: the residual stream's new
  dimensions start at zero, and nothing writes to them (below), so they stay zero;
- attention gets heads whose Q, K and V rows and output columns are zero (head_dim kept, written as
  key_length / value_length); the real query heads move to slots that share their KV head, so any
  grouping of the new head counts works (a zero query attends uniformly, and its zero output
  columns drop what it reads);
- the FFN gets zero rows and columns (SiLU(0) * 0 = 0);
- new layers get zero weights everywhere: their attention output and FFN down are zero, so the
  residual passes them unchanged;
- every RMSNorm weight is scaled by sqrt(d/D) and the norm epsilon set to eps * d/D: the mean of
  squares over D dimensions of which only d are non-zero is d/D of the mean over d.

llama.cpp then computes the original logits up to rounding (F32: a few 1e-5; F16 weights: a few 1e-2)
and the same greedy text. Acceptance with a draft that is the same model quantized runs higher than a
real 8B/1B pair's: say so wherever its figures appear, and set the poor Q2_K draft beside it.

The file is written one tensor at a time, its zero runs as holes (a sparse file): Llama-3-8B's shapes
come to 13.4 GiB in F16 of which about 2 GiB are written.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from localspec.cache import ModelError, Progress, say, sha256_file, temp_beside

FTYPES = {"F32": (np.float32, 0), "F16": (np.float16, 1)}  # widened ftype -> (weights' dtype, general.file_type)
SHAPE_KEYS = ("n_embd", "n_head", "n_head_kv", "n_ff", "n_layer")
CHUNK = 1 << 20  # bytes written (or skipped, where all zero) at a time
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down")


@dataclass(frozen=True)
class Shape:
    """The widened model's shapes: width, query and KV heads (of the original head size), FFN
    width, layers."""

    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_layer: int

    @classmethod
    def from_table(cls, where: str, raw: object) -> "Shape":
        if not isinstance(raw, dict) or set(raw) != set(SHAPE_KEYS):
            raise ModelError(f"{where}: source.widen must be a table of {', '.join(SHAPE_KEYS)}")
        values = {k: raw[k] for k in SHAPE_KEYS}
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values.values()):
            raise ModelError(f"{where}: source.widen's values must be positive integers")
        if values["n_head"] % values["n_head_kv"]:
            raise ModelError(f"{where}: source.widen's n_head must be a multiple of n_head_kv")
        return cls(**values)

    def describe(self) -> str:
        return (f"{self.n_embd} wide, {self.n_head}/{self.n_head_kv} heads, FFN {self.n_ff}, "
                f"{self.n_layer} layers")


@dataclass(frozen=True)
class _Original:
    """What the widening needs of the source model's shapes."""

    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_layer: int
    head_dim: int
    eps: float


def widen_gguf(src: Path, dest: Path, shape: Shape, ftype: str = "F16", *, label: str | None = None,
               progress: Progress | None = None) -> str:
    """Write `src` (a llama-architecture GGUF) widened to `shape` as `ftype` (F16 or F32) into
    `dest`, atomically. Returns the sha256 of the result."""
    import gguf  # ggml-org's reader and writer (only deriving needs it)

    label = label or Path(dest).name
    if ftype not in FTYPES:
        raise ModelError(f"{label}: a widened model is F16 or F32, not {ftype}")
    reader = gguf.GGUFReader(src)
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise ModelError(f"{label}: only a llama-architecture model can be widened, not {arch!r}")
    old = _original(fields, label)
    _check(old, shape, label)
    dtype, file_type = FTYPES[ftype]
    tensors = {t.name: t for t in reader.tensors}
    plan = list(_plan(tensors, old, shape, dtype, label))
    tmp = temp_beside(Path(dest))
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        _copy_metadata(writer, reader, fields, old, shape, file_type)
        for name, new_shape, new_dtype, _ in plan:
            writer.add_tensor_info(name, new_shape, np.dtype(new_dtype),
                                   math.prod(new_shape) * np.dtype(new_dtype).itemsize)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]
        written = 0
        for i, (name, _, _, build) in enumerate(plan):
            written += _write_sparse(fout, build(), writer.data_alignment)
            if progress is not None and i % 64 == 63:
                say(progress, f"  {label}: {i + 1}/{len(plan)} tensors")
        fout.truncate()  # the file ends where its last tensor's padding does, holes included
        writer.close()
        say(progress, f"  {label}: {os.path.getsize(tmp) / 2**30:.1f} GiB, {written / 2**30:.2f} GiB of it written "
                      "(the zero runs are holes)")
        actual = sha256_file(tmp)
        os.replace(tmp, dest)
        return actual
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)


def _original(fields: Mapping[str, Any], label: str) -> _Original:
    try:
        d = int(fields["llama.embedding_length"])
        n_head = int(fields["llama.attention.head_count"])
        head_dim = int(fields.get("llama.attention.key_length", d // n_head))
        if int(fields.get("llama.attention.value_length", head_dim)) != head_dim:
            raise ModelError(f"{label}: keys and values of different sizes cannot be widened")
        return _Original(d, n_head, int(fields.get("llama.attention.head_count_kv", n_head)),
                         int(fields["llama.feed_forward_length"]), int(fields["llama.block_count"]), head_dim,
                         float(fields["llama.attention.layer_norm_rms_epsilon"]))
    except KeyError as e:
        raise ModelError(f"{label}: the model's metadata lacks {e.args[0]}") from None


def _check(old: _Original, new: Shape, label: str) -> None:
    group, new_group = old.n_head // old.n_head_kv, new.n_head // new.n_head_kv
    problems = [what for what, bad in (
        (f"n_embd {new.n_embd} < {old.n_embd}", new.n_embd < old.n_embd),
        (f"n_head {new.n_head} < {old.n_head}", new.n_head < old.n_head),
        (f"n_head_kv {new.n_head_kv} < {old.n_head_kv}", new.n_head_kv < old.n_head_kv),
        (f"{new_group} query heads per KV head < the original's {group}", new_group < group),
        (f"n_ff {new.n_ff} < {old.n_ff}", new.n_ff < old.n_ff),
        (f"n_layer {new.n_layer} < {old.n_layer}", new.n_layer < old.n_layer)) if bad]
    if problems:
        raise ModelError(f"{label}: cannot widen to {new.describe()}: " + "; ".join(problems))


def _slots(old: _Original, new: Shape) -> list[int]:
    """The new slot of each original query head: the same place in the group of the same KV head."""
    group, new_group = old.n_head // old.n_head_kv, new.n_head // new.n_head_kv
    return [(i // group) * new_group + i % group for i in range(old.n_head)]


Builder = Callable[[], np.ndarray]


def _plan(tensors: Mapping[str, Any], old: _Original, new: Shape, dtype,
          label: str) -> Iterator[tuple[str, tuple[int, ...], Any, Builder]]:
    """(name, numpy shape, dtype, build) of each tensor of the widened model, in file order."""
    hd, scale = old.head_dim, math.sqrt(old.n_embd / new.n_embd)
    slots = _slots(old, new)
    known = {"token_embd.weight", "output.weight", "output_norm.weight", "rope_freqs.weight"}
    known |= {f"blk.{i}.{t}.weight" for i in range(old.n_layer) for t in LAYER_TENSORS}
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise ModelError(f"{label}: cannot widen a model with tensor(s) {', '.join(unknown[:5])}")

    def source(name: str) -> np.ndarray:
        t = tensors[name]
        if t.tensor_type.name not in ("F32", "F16"):
            raise ModelError(f"{label}: widen an F32 or F16 model ({name} is {t.tensor_type.name})")
        return np.asarray(t.data, dtype=np.float32)

    def padded(name: str, shape: tuple[int, ...], place: Callable[[np.ndarray, np.ndarray], None],
               out_dtype=dtype) -> Builder:
        def build() -> np.ndarray:
            out = np.zeros(shape, dtype=out_dtype)  # untouched pages stay unallocated (and unwritten: holes)
            place(out, source(name))
            return out
        return build

    def corner(out: np.ndarray, src: np.ndarray) -> None:
        out[tuple(slice(0, n) for n in src.shape)] = src

    def norm(out: np.ndarray, src: np.ndarray) -> None:
        out[:len(src)] = src * scale

    def query_rows(out: np.ndarray, src: np.ndarray) -> None:  # [heads * hd, d]
        for i, slot in enumerate(slots):
            out[slot * hd:(slot + 1) * hd, :src.shape[1]] = src[i * hd:(i + 1) * hd]

    def output_columns(out: np.ndarray, src: np.ndarray) -> None:  # [d, heads * hd]
        for i, slot in enumerate(slots):
            out[:src.shape[0], slot * hd:(slot + 1) * hd] = src[:, i * hd:(i + 1) * hd]

    D, q, kv, ff = new.n_embd, new.n_head * hd, new.n_head_kv * hd, new.n_ff
    for name in ("token_embd.weight", "output.weight"):
        if name in tensors:
            n_vocab = tensors[name].data.shape[0]
            yield name, (n_vocab, D), dtype, padded(name, (n_vocab, D), corner)
    yield "output_norm.weight", (D,), np.float32, padded("output_norm.weight", (D,), norm, np.float32)
    if "rope_freqs.weight" in tensors:  # per rotated pair of a head: the head size is kept
        yield "rope_freqs.weight", tensors["rope_freqs.weight"].data.shape, np.float32, \
            lambda: source("rope_freqs.weight")
    shapes = {"attn_norm": (D,), "ffn_norm": (D,), "attn_q": (q, D), "attn_k": (kv, D), "attn_v": (kv, D),
              "attn_output": (D, q), "ffn_gate": (ff, D), "ffn_up": (ff, D), "ffn_down": (D, ff)}
    places = {"attn_norm": norm, "ffn_norm": norm, "attn_q": query_rows, "attn_k": corner, "attn_v": corner,
              "attn_output": output_columns, "ffn_gate": corner, "ffn_up": corner, "ffn_down": corner}
    for layer in range(new.n_layer):
        for t in LAYER_TENSORS:
            name, shape = f"blk.{layer}.{t}.weight", shapes[t]
            t_dtype = np.float32 if t.endswith("norm") else dtype
            if layer < old.n_layer:
                yield name, shape, t_dtype, padded(name, shape, places[t], t_dtype)
            else:  # a new layer: zero everywhere, its attention output and FFN down included
                yield name, shape, t_dtype, (lambda shape=shape, t_dtype=t_dtype: np.zeros(shape, dtype=t_dtype))


def _copy_metadata(writer, reader, fields: Mapping[str, Any], old: _Original, new: Shape, file_type: int) -> None:
    """Every key of the source but its shapes and file type (the tokenizer verbatim: a draft of the
    original vocabulary drafts for it), the widened shapes, and the norm epsilon scaled by d/D."""
    import gguf

    replaced = {"general.architecture", "general.file_type", "llama.embedding_length", "llama.feed_forward_length",
                "llama.attention.head_count", "llama.attention.head_count_kv", "llama.block_count",
                "llama.attention.layer_norm_rms_epsilon", "llama.attention.key_length",
                "llama.attention.value_length"}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in replaced:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, fields[name], vtype, sub_type=sub)
    writer.add_uint32("general.file_type", file_type)
    writer.add_uint32("llama.embedding_length", new.n_embd)
    writer.add_uint32("llama.feed_forward_length", new.n_ff)
    writer.add_uint32("llama.attention.head_count", new.n_head)
    writer.add_uint32("llama.attention.head_count_kv", new.n_head_kv)
    writer.add_uint32("llama.block_count", new.n_layer)
    writer.add_uint32("llama.attention.key_length", old.head_dim)
    writer.add_uint32("llama.attention.value_length", old.head_dim)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", old.eps * old.n_embd / new.n_embd)


def _write_sparse(fout, data: np.ndarray, alignment: int) -> int:
    """Write `data` at the next `alignment` boundary, seeking over its all-zero chunks (holes in the
    file); returns the bytes written."""
    fout.seek(-fout.tell() % alignment, os.SEEK_CUR)
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    written = 0
    for lo in range(0, len(raw), CHUNK):
        chunk = raw[lo:lo + CHUNK]
        if chunk.any():
            fout.write(chunk.tobytes())
            written += len(chunk)
        else:
            fout.seek(len(chunk), os.SEEK_CUR)
    fout.seek(-fout.tell() % alignment, os.SEEK_CUR)
    return written
