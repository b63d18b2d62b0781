"""Unit tests: no process stack (the quick loop: `pytest tests/unit`)."""
