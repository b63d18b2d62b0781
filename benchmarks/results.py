"""The one shape every benchmark reports in, so `benchmarks/run_all.py` can write RESULTS.md.

A benchmark script takes `--json PATH` and, besides printing its own table, writes there a list of
rows made with `row(...)`: one comparison each, rollmesh beside its baseline measured in the same
run. `run_all.py` gathers the files into the table of `benchmarks/RESULTS.md`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def row(figure: str, rollmesh: float, baseline: float, unit: str, *, baseline_name: str,
        higher_is_better: bool, target: float | None = None, command: str = "",
        note: str = "") -> dict[str, Any]:
    """One comparison. The ratio is always "how many times better rollmesh is" when
    higher_is_better (rollmesh / baseline), else the cost ratio rollmesh / baseline (lower is
    better; a target then is a ceiling, e.g. "within 1.3x of the floor")."""
    ratio = rollmesh / baseline if baseline else float("nan")
    met = None
    if target is not None:
        met = ratio >= target if higher_is_better else ratio <= target
    return {"figure": figure, "rollmesh": rollmesh, "baseline": baseline, "unit": unit,
            "baseline_name": baseline_name, "ratio": ratio, "higher_is_better": higher_is_better,
            "target": target, "met": met, "command": command or " ".join(sys.argv),
            "note": note}


def write(path: str | Path | None, rows: list[dict[str, Any]]) -> None:
    if path:
        Path(path).write_text(json.dumps(rows, indent=1))
