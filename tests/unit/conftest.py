"""Unit tests start no process stack; one marked `slow` belongs in tests/e2e/."""

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/unit/" in str(item.path) and item.get_closest_marker("slow"):
            raise pytest.UsageError(f"{item.nodeid} is marked slow: move it to tests/e2e/")
