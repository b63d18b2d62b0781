"""End-to-end tests: they start processes (roles, launches, engines)."""
