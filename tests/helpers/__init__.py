"""Test-only support code: what the tests need and the package does not."""
