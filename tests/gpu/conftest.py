"""tests/gpu: the checks that need CUDA. Every test here is skipped, with the reason, on a host
without a GPU (this project's CPU machines and its CI); run them on a GPU host with
`.venv/bin/python -m pytest tests/gpu -v`."""

from __future__ import annotations

import pytest
import torch

NO_CUDA = "CUDA is not available on this host: tests/gpu runs only on a GPU machine"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if "tests/gpu/" in str(item.path).replace("\\", "/"):
            item.add_marker(skip)
