"""Fixtures for the engine tests (helpers live in engine_harness.py)."""

from __future__ import annotations

import pytest
from engine_harness import Engine


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory):
    """A shared tiny engine for tests that leave its weights and version alone."""
    e = Engine(tmp_path_factory.mktemp("engine") / "engine.log")
    yield e
    e.stop()


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer) of `tiny`, built in the test process: the engine's exact weights."""
    import torch

    from rollmesh.models.loading import build_tiny

    return build_tiny("tiny")


@pytest.fixture(autouse=True)
def _no_grad():
    """Reference computations need no gradients; scoped to each engine test so that grad mode
    never leaks into other tests of the session."""
    import torch

    with torch.no_grad():
        yield
