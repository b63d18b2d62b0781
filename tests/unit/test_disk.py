"""Disk trouble (issue 13, item 6): the MessageQueue's log and the rollouter's journal meet a
full disk (a 1 MiB tmpfs filled with a ballast file; deleting it gives the space back).

What must hold: the error names the file (in the reply, the log and the role's status), the
failed write changes nothing (nothing acknowledged that is not on disk), the file holds only
whole records (it reopens with nothing to cut off), and once space returns the same requests
succeed: the run goes on. Needs root to mount the tmpfs; skipped otherwise, with the reason.
"""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import pytest

from rollmesh.rollout.data import PromptGroup, PromptRow
from rollmesh.runtime.durable_log import DurableLog
from rollmesh.rollout.journal import Journal, JournalDiskError


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs here ({done.stderr.strip() or 'not root'})")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk: Path) -> Path:
    """Write a ballast file until the disk is full; deleting it gives the space back."""
    ballast = disk / "ballast"
    with open(ballast, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    return ballast


def whole_records(path: Path) -> int:
    """The records of a log file, asserting it holds nothing torn."""
    log, records = DurableLog.open(path)
    assert log.discarded_bytes == 0
    log.close()
    return len(records)


def test_rollouter_journal_full_disk_names_the_file_changes_nothing_and_goes_on(small_disk):
    path = small_disk / "rollouter" / "rollouter.log"
    journal = Journal(path, None)
    def admit(i: int) -> None:
        journal.admitted(PromptGroup(group_id=f"g{i}", row=PromptRow(index=i, prompt="p"),
                                     group_size=4, epoch=0), {"pos": i, "pad": "x" * 300}, 0)

    for i in range(3):
        admit(i)
    ballast = fill(small_disk)
    failed = None
    for i in range(3, 2000):
        try:
            admit(i)
        except JournalDiskError as e:
            failed = (i, str(e))
            break
    assert failed is not None
    i, error = failed
    assert error == f"rollouter cannot write its journal {path}: No space left on device"
    assert journal.error == f"{path}: No space left on device"
    assert f"g{i}" not in journal.groups and journal.cursor["pos"] == i - 1
    assert journal.counters["admitted_groups"] == i  # the failed admit changed nothing
    replay = Journal(path, None)  # what a restarted rollouter would see: whole records only
    assert replay.file.discarded_bytes == 0
    assert replay.cursor["pos"] == i - 1 and replay.counters == journal.counters
    replay.close()
    ballast.unlink()
    admit(i)
    journal.close()
    final = Journal(path, None)
    assert final.counters["admitted_groups"] == i + 1 and final.cursor["pos"] == i
    final.close()
