"""Every test here starts processes: it is `slow` by its folder (the quick loop is
`pytest tests/unit`; `-m "not slow"` leaves these out as well)."""

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/e2e/" in str(item.path):
            item.add_marker(pytest.mark.slow)
