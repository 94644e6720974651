"""A release a user can install (issue 41, item 3): `python -m build` makes the sdist and, from it,
the wheel; `twine check` passes on both; the version is written once; and the wheel, installed into
a fresh virtual environment with no source tree on its path, runs `localspec --version`, `models`,
`generate` and `serve` (the chat page and /docs from the installed package), in a folder outside
the checkout.

The fresh environment gets localspec's dependencies from this interpreter's site-packages through a
filtered view (tests/test_release.py: dependency_view), since llama-cpp-python is a local native
build no test can afford to repeat; localspec itself comes only from the wheel. The build is
isolated as a release's is: it fetches setuptools from PyPI (pip's cache, after the first time)."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import httpx
import pytest
from serving import free_port, wait_ready

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the package depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.release

# what a checkout holds that is no part of a release, where git cannot say (an unpacked sdist)
_NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc",
                                     ".pytest_cache", ".gpu_carry", ".gpu_models")


def source_version() -> str:
    """`__version__` as localspec/__init__.py writes it (read, not imported)."""
    tree = ast.parse((ROOT / "localspec" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__version__"]:
            return ast.literal_eval(node.value)
    raise AssertionError("localspec/__init__.py sets no __version__")


def copy_source(dest: Path) -> list[str]:
    """Copy the checkout's files to `dest`: what git tracks or would (untracked, not ignored), symlinks
    kept as links; outside a git checkout, the tree less caches and build output. The relative paths."""
    try:
        listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard"], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(ROOT, dest, symlinks=True, ignore=_NOT_SOURCE)
        return sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if not p.is_dir())
    names = sorted(n for n in listed.decode().split("\0") if n and os.path.lexists(ROOT / n))
    for name in names:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, dest / name, follow_symlinks=False)
    return names


def dependency_view(dest: Path) -> list[Path]:
    """For each of this interpreter's site-packages folders, a folder under `dest` of symlinks to its
    entries less anything of localspec's (the editable install's `__editable__*` finder and .pth, a
    `localspec*` package or dist-info) and less every .pth file (a view added by a .pth path line has
    its own .pth files skipped anyway). The views, in sys.path order."""
    import site

    folders = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        folders.append(site.getusersitepackages())
    views = []
    for i, folder in enumerate(f for f in folders if os.path.isdir(f)):
        view = dest / f"site{i}"
        view.mkdir(parents=True)
        for entry in os.scandir(folder):
            if not entry.name.lower().startswith(("localspec", "__editable__")) and not entry.name.endswith(".pth"):
                (view / entry.name).symlink_to(entry.path)
        views.append(view)
    return views


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict:
    """`python -m build` on a copy of the checkout: {"source": the copy, "files": its relative paths,
    "sdist", "wheel": the two files built}."""
    base = tmp_path_factory.mktemp("release")
    source, out = base / "source", base / "dist"
    files = copy_source(source)
    build = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(source)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    sdists, wheels = list(out.glob("*.tar.gz")), list(out.glob("*.whl"))
    assert len(sdists) == len(wheels) == 1, sorted(p.name for p in out.iterdir())
    return {"source": source, "files": files, "sdist": sdists[0], "wheel": wheels[0]}


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> dict:
    """A fresh venv (no pip of its own: this interpreter's pip installs into it with --python) that sees
    localspec's dependencies through `dependency_view` and holds the wheel, installed with --no-index
    (so pip must find every requirement the wheel declares already satisfied). {"bin", "python",
    "site", "env", "cwd"}: `env` is this process's environment without PYTHON* variables (no
    PYTHONPATH), VIRTUAL_ENV or LOCALSPEC_MODELS, the venv's bin/ first on PATH; `cwd` an empty folder
    outside the checkout."""
    base = tmp_path_factory.mktemp("fresh")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(base / "venv")], check=True, timeout=120)
    python = base / "venv" / "bin" / "python"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYTHON") and k not in ("VIRTUAL_ENV", "LOCALSPEC_MODELS")}
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONNOUSERSITE"] = "1"  # the user's own site-packages, if this process uses one, is in the view
    site_dir = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   env=env, capture_output=True, text=True, check=True).stdout.strip())
    views = dependency_view(base / "deps")
    (site_dir / "_localspec_test_deps.pth").write_text("".join(f"{v}\n" for v in views))
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
                              "--no-cache-dir", "--disable-pip-version-check", str(dist["wheel"])],
                             env=env, capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    cwd = base / "work"
    cwd.mkdir()
    return {"bin": python.parent, "python": python, "site": site_dir, "env": env, "cwd": cwd}


def run_in(venv: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a command from the fresh venv's bin/ in its work folder and environment; it must succeed."""
    p = subprocess.run([str(venv["bin"] / args[0]), *args[1:]], cwd=venv["cwd"], env=venv["env"],
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, (args, p.stdout[-2000:], p.stderr[-3000:])
    return p


def wheel_metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(name).decode())


def package_files(files: list[str]) -> set[str]:
    return {f for f in files if f.startswith("localspec/")}


# ---------------------------------------------------------------------------------- what is built


def test_the_version_is_written_once():
    """localspec/__init__.py's __version__ is the version: pyproject.toml reads it (no version of its
    own), and CHANGELOG.md's newest release is that version."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "localspec.__version__"}
    releases = re.findall(r"^## \[(\d[^\]]*)\] - \d{4}-\d{2}-\d{2}$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases and releases[0] == source_version(), releases


def test_the_sdist_holds_what_building_and_testing_need(dist):
    """Every source file of the package, the tests, scripts/ and docs/; the licence, changelog and
    README; models.toml at the root (the tests read it) and in the package as a real file (in the
    checkout it is a symlink)."""
    with tarfile.open(dist["sdist"]) as tar:
        members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name}
        package_toml = tar.extractfile(members["localspec/models.toml"]).read()
    wanted = {f for f in dist["files"] if f.split("/")[0] in ("localspec", "tests", "scripts", "docs")}
    wanted |= {"pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "MANIFEST.in", "models.toml"}
    assert not wanted - members.keys(), sorted(wanted - members.keys())
    assert members["localspec/models.toml"].isfile() and package_toml == (ROOT / "models.toml").read_bytes()
    assert not [n for n in members if "__pycache__" in n or n.endswith(".pyc") or n.startswith("benchmarks/")]


def test_the_wheel_holds_the_package_and_its_data_and_nothing_else(dist):
    """The wheel's localspec/ is exactly the checkout's (static/ and static/apidocs/, the bench
    workloads, models.toml), and nothing outside localspec/ but its .dist-info."""
    with zipfile.ZipFile(dist["wheel"]) as z:
        names = set(z.namelist())
        assert z.read("localspec/models.toml") == (ROOT / "models.toml").read_bytes()
    assert {n for n in names if n.startswith("localspec/")} == package_files(dist["files"])
    for data in ("localspec/server/static/index.html", "localspec/server/static/apidocs/swagger-ui-bundle.js",
                 "localspec/bench/workloads/chat.jsonl"):
        assert data in names
    info = {n.split("/")[0] for n in names if not n.startswith("localspec/")}
    assert info == {f"localspec-{source_version()}.dist-info"}, info


def test_the_wheel_metadata_is_complete(dist):
    """Name, version, licence (expression and files), classifiers, project URLs, the README as its
    description, requires-python, keywords, the dependencies pyproject.toml declares and the script."""
    meta = wheel_metadata(dist["wheel"])
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["Name"] == "localspec" and meta["Version"] == source_version()
    assert meta["License-Expression"] == project["license"] and "MIT" in meta["License-Expression"]
    assert "LICENSE" in meta.get_all("License-File")
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    classifiers = meta.get_all("Classifier")
    assert "Programming Language :: Python :: 3.11" in classifiers and any(c.startswith("Development Status")
                                                                         for c in classifiers)
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert urls["Homepage"].startswith("https://") and {"Repository", "Changelog"} <= urls.keys()
    assert meta["Requires-Python"] == project["requires-python"] and meta["Keywords"]
    assert meta["Description-Content-Type"] == "text/markdown"
    assert meta.get_payload().strip() == (ROOT / "README.md").read_text().strip()
    plain = [r for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    assert len(plain) == len(project["dependencies"])
    with zipfile.ZipFile(dist["wheel"]) as z:
        scripts = z.read(f"localspec-{source_version()}.dist-info/entry_points.txt").decode()
    assert "localspec = localspec.cli:entry" in scripts


def test_twine_check_passes(dist):
    p = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(dist["sdist"]), str(dist["wheel"])],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("PASSED") == 2, p.stdout


# ---------------------------------------------------------------------------------- what is installed


def test_the_fresh_venv_imports_localspec_from_the_wheel_alone(venv):
    """localspec is the installed wheel's (its files in the venv's site-packages, one distribution of
    that name in sight) and no path of the checkout is on sys.path."""
    assert ROOT not in venv["cwd"].parents
    probe = ("import importlib.metadata as md, json, sys, localspec\n"
             "print(json.dumps({'file': localspec.__file__, 'version': localspec.__version__, 'path': sys.path,"
             " 'dists': [str(d.locate_file('')) for d in md.distributions() if d.metadata['Name'] == 'localspec']}))")
    seen = json.loads(run_in(venv, "python", "-c", probe).stdout)
    assert Path(seen["file"]).resolve() == (venv["site"] / "localspec" / "__init__.py").resolve()
    assert seen["version"] == source_version() and seen["dists"] == [str(venv["site"])], seen
    assert not [p for p in seen["path"] if p and Path(p).resolve().is_relative_to(ROOT)], seen["path"]


def test_version_and_models_from_the_installed_wheel(venv):
    assert run_in(venv, "localspec", "--version").stdout.strip() == f"localspec, version {source_version()}"
    listed = json.loads(run_in(venv, "localspec", "models", "--json").stdout)
    shipped = tomllib.loads((ROOT / "models.toml").read_text())
    assert [m["name"] for m in listed["models"]] == list(shipped["models"])
    assert [p["name"] for p in listed["pairs"] if p["default"]] == [shipped["default_pair"]]


@pytest.mark.model
def test_generate_from_the_installed_wheel(venv, pair_paths, tmp_path):
    """`localspec generate` with default settings: the default pair from the cache, speculating, as a
    new user's first run (no costs kept: the suite's shared store holds what earlier tests taught,
    and an 8-token answer started idle from one such state once)."""
    fresh = {**venv, "env": {**venv["env"], "LOCALSPEC_COST_CACHE": str(tmp_path)}}
    out = json.loads(run_in(fresh, "localspec", "generate", "Say hello.", "--max-tokens", "8",
                                          "--json").stdout)
    assert out["text"].strip() and out["stats"]["completion_tokens"] >= 1 and out["stats"]["steps"] >= 1
    assert out["stats"]["drafted"] >= 1, out["stats"]


@pytest.mark.model
def test_serve_from_the_installed_wheel_with_its_chat_page_and_docs(venv, pair_paths):
    """`localspec serve` answers a chat request, and serves the chat page and /docs, every file of
    them byte for byte the package's; /openapi.json names the version."""
    from localspec.server import apidocs, webui

    port = free_port()
    proc = subprocess.Popen([str(venv["bin"] / "localspec"), "serve", "--port", str(port)], cwd=venv["cwd"],
                            env=venv["env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = wait_ready({"proc": proc, "url": f"http://127.0.0.1:{port}", "ready": False})
        static = ROOT / "localspec" / "server" / "static"
        pages = [(path, static / name) for path, name in webui.FILES.items()]
        pages += [(path, static / "apidocs" / name) for path, name in apidocs.FILES.items()]
        for path, file in pages:
            r = httpx.get(url + path, timeout=10)
            assert r.status_code == 200 and r.content == file.read_bytes(), path
        assert httpx.get(url + "/openapi.json", timeout=10).json()["info"]["version"] == source_version()
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-3000:]
