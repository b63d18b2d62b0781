"""The launcher's mirror of a remote trainer's metrics.jsonl: each row copied once.

CI once saw a run over SSH end with steps 3..8 twice in the run directory's metrics.jsonl:
the status loop's mirror (in a thread, `asyncio.to_thread`) was still reading the remote file
when the run's last mirror started, and a cancelled task does not stop its thread. Both read
from the same offset and both appended the same rows.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from rollmesh.config import load_cluster
from rollmesh.launcher.hosts import LocalHost

ROOT = Path(__file__).resolve().parents[2]


class SlowRemote(LocalHost):
    """A host that is not this one, whose file reads take as long as an ssh round trip."""

    local = False

    def read_from(self, path: str, offset: int) -> bytes:
        data = super().read_from(path, offset)
        time.sleep(0.3)
        return data


def test_two_mirrors_at_once_append_each_new_row_once(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from rollmesh.launcher.launcher import Launcher

    monkeypatch.chdir(ROOT)  # the cluster file's paths are relative to the repo root
    launcher = Launcher(load_cluster(ROOT / "launch/local.toml"), tmp_path / "run", echo=False)
    launcher.run_dir.mkdir()
    trainer0 = next(p for p in launcher.plan if p.proc.role == "trainer")
    remote = tmp_path / "remote"
    remote.mkdir()
    trainer0.host = SlowRemote(trainer0.host.name, trainer0.host.cfg)
    trainer0.host.workdir = str(remote)
    trainer0.config["metrics_path"] = "metrics.jsonl"
    rows = "".join(f'{{"step": {s}}}\n' for s in range(1, 9))
    (remote / "metrics.jsonl").write_text(rows[: rows.index('{"step": 3}')])
    launcher.mirror_metrics()  # steps 1 and 2 are here
    (remote / "metrics.jsonl").write_text(rows + '{"step": 9')  # and a line being written

    mirrors = [threading.Thread(target=launcher.mirror_metrics) for _ in range(2)]
    for t in mirrors:
        t.start()
    for t in mirrors:
        t.join()
    assert (launcher.run_dir / "metrics.jsonl").read_text() == rows
