"""The model cache: where files live, their sha256, and the ``.sha256`` sidecars that remember it.

Each cached file gets a ``<file>.sha256`` sidecar (``sha256sum -c`` compatible) holding its sha256
and the size and mtime it had when last verified, so a file is re-hashed only when its size or
mtime changed.  Files are written to a temporary file beside their final name and renamed into
place; a per-file ``fcntl`` lock keeps two processes from fetching the same model at once.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Callable, Iterator

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no cross-process locking
    fcntl = None  # type: ignore[assignment]

Progress = Callable[[str], None]

CHUNK = 1 << 20
HEX64 = re.compile(r"^[0-9a-f]{64}$")


class ModelError(Exception):
    """A model could not be found, fetched, derived or verified (one-line message)."""


def say(progress: Progress | None, message: str) -> None:
    if progress is not None:
        progress(message)


def human_size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError  # unreachable


# ----------------------------------------------------------------------------- paths


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


def models_dir() -> Path:
    path = cache_dir() / "models"
    path.mkdir(exist_ok=True)
    return path


def temp_beside(dest: Path) -> Path:
    """A new empty file next to dest (like mkstemp, but with umask-respecting permissions)."""
    while True:
        tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


def check_free_space(directory: Path, need: int, *, label: str, more: str = "") -> None:
    """ModelError when the disk holding directory has less than ``need`` bytes free: said before a
    fetch writes its first byte, not when the disk is full, the file half written and every other
    program on that disk short of space too.  ``more`` follows the size needed in the message."""
    free = shutil.disk_usage(directory).free
    if need > free:
        raise ModelError(f"{label}: not enough disk space: needs {human_size(need)}{more}, "
                         f"{human_size(free)} free on {directory}")


def write_text_atomically(dest: Path, text: str) -> None:
    """Write `text` (UTF-8) to dest through a temporary file beside it, renamed into place: a reader
    sees the old file or the whole new one, never part of it. On failure the temporary file is
    removed and the error raised."""
    tmp = temp_beside(dest)
    try:
        tmp.write_text(text, "utf-8")
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove_leftovers(dest: Path) -> None:
    """What killed fetches of dest left beside it: temporary files (``temp_beside``) and pip's
    download directories; never the partial file a download resumes from.  Hold dest's lock."""
    prefix = f".{glob.escape(dest.name)}."
    for stale in dest.parent.glob(prefix + "*.tmp"):
        stale.unlink(missing_ok=True)
    for stale in dest.parent.glob(prefix + "pip-download-*"):
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def locked(path: Path, label: str, progress: Progress | None) -> Iterator[None]:
    """Exclusive lock on ``<path>.lock`` (across processes and threads) while fetching ``path``."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(progress, f"waiting for another process that is fetching {label} ...")
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


# ----------------------------------------------------------------------------- sha256


def sha256_file(path: Path | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


# sha256 of files already hashed by this process, keyed by identity and stat
HASHED: dict[tuple, str] = {}


def sha256_memo(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in HASHED:
        HASHED[key] = sha256_file(path)
    return HASHED[key]


def check_sha(label: str, expected: str | None, actual: str) -> None:
    if expected is not None and actual != expected.lower():
        raise ModelError(f"sha256 mismatch for {label}: expected {expected.lower()}, got {actual}")


# ----------------------------------------------------------------------------- sidecars (fingerprints)


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


_STAMP = re.compile(r"^# verified size=(\d+) mtime_ns=(\d+)$", re.M)


def read_sidecar(path: Path) -> str | None:
    """The sha256 recorded for path, if any."""
    try:
        words = sidecar(path).read_text("utf-8").split()
    except (OSError, UnicodeDecodeError):
        return None
    return words[0].lower() if words and HEX64.match(words[0].lower()) else None


def sidecar_stamp(path: Path) -> tuple[int, int] | None:
    """(size, mtime_ns) of path when its sha256 was last verified."""
    try:
        m = _STAMP.search(sidecar(path).read_text("utf-8"))
    except (OSError, UnicodeDecodeError):
        return None
    return (int(m.group(1)), int(m.group(2))) if m else None


def write_sidecar(path: Path, sha: str) -> None:
    """Record that path (as it is now) has this sha256.  sha256sum skips the '#' line."""
    st = path.stat()
    write_text_atomically(sidecar(path), f"{sha}  {path.name}\n# verified size={st.st_size} mtime_ns={st.st_mtime_ns}\n")
