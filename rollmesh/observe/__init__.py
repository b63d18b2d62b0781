"""Watching a run: `rollmesh monitor` (`monitor`) and `rollmesh plot` (`plot`)."""
