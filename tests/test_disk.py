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
from rollmesh.mq.store import LOG_NAME
from rollmesh.rollout.journal import Journal, JournalDiskError
from rollmesh.wire.transport import RemoteError, RpcClient
from tests.helpers.queue import put_group
from tests.test_message_queue import balance, group, kill_and_respawn, spawn_queue, stats
from tests.test_trainer import with_supervisor


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


@pytest.mark.slow
def test_queue_log_full_disk_refuses_puts_naming_the_file_then_resumes(tmp_path, small_disk):
    async def body(t, sup):
        mq = spawn_queue(sup, small_disk / "mq", fsync_interval_s=0)
        address = (await sup.wait_ready(mq, 60))["rpc"]
        client = RpcClient(t, address, timeout_s=5, retries=3)
        for i in range(3):
            assert await put_group(client, group(i))
        ballast = fill(small_disk)
        refused = None
        for i in range(3, 40):  # the tmpfs's last page may still take a record or two
            try:
                assert await put_group(client, group(i, tokens=512))
            except RemoteError as e:
                refused = (i, str(e))
                break
        assert refused is not None, "the full disk never refused a put"
        i, error = refused
        path = small_disk / "mq" / LOG_NAME
        assert f"cannot write its log {path}: No space left on device" in error
        during = await stats(client)
        assert during["log_error"] == f"{path}: No space left on device"
        assert balance(during) == 0 and during["log_write_failures"] >= 1
        # the refused group is not in the queue: what is on disk is exactly what was accepted
        assert whole_records(path) == during["put_samples"] // 2
        ballast.unlink()  # space returns; the caller retries the same put
        assert await put_group(client, group(i, tokens=512))
        after = await stats(client)
        assert after["log_error"] is None and balance(after) == 0
        assert after["put_samples"] == during["put_samples"] + 2 and after["duplicate_puts"] == 0
        mq = await kill_and_respawn(sup, mq)  # the log replays whole
        replayed = await stats(client)
        assert replayed["put_samples"] == after["put_samples"] and balance(replayed) == 0
        client.close()
        return (tmp_path / "logs" / "message_queue-0.log").read_text()

    text = with_supervisor(tmp_path, body)
    assert "log_write_failed" in text and str(small_disk / "mq" / LOG_NAME) in text
    assert "log_write_recovered" in text and "log_torn_tail" not in text


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
