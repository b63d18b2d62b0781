"""Code that only the tests use: kept out of the rollmesh package, imported as `tests.helpers.*`."""
