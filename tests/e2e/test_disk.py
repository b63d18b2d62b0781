"""End-to-end tests of disk (they start processes); the unit tests and the
helpers they share are in tests/unit/test_disk.py."""

from __future__ import annotations

import json

import pytest

from rollmesh.mq.store import LOG_NAME
from rollmesh.wire.transport import RemoteError, RpcClient
from tests.helpers.queue import put_group
from tests.unit.test_disk import fill, whole_records
from tests.unit.test_disk import small_disk  # noqa: F401 - pytest fixtures
from tests.unit.test_message_queue import balance, group, kill_and_respawn, spawn_queue, stats
from tests.unit.test_trainer import with_supervisor


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


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_full_disk_under_the_rollouters_journal_in_a_whole_run_loses_nothing(tmp_path):
    """A launched run whose rollouter journal (RUN/rollouter) sits on a 4 MiB tmpfs: the disk is
    filled mid-run. The rollouter's next journal write fails naming the file (nothing it did not
    write is acknowledged), it stops and the launcher restarts it; with the space back within
    its restarts, the restarted rollouter replays its journal and the run finishes with
    everything accounted for and nothing trained twice (RELIABILITY.md listed this as not
    covered)."""
    import subprocess
    import time

    from tests.e2e.test_launcher import (
        ROOT, assert_nothing_trained_twice, check_accounting, finish, launch, metrics, wait_for,
    )

    import shutil
    import signal
    import sys

    run_dir = tmp_path / "run"
    steps = 60
    # A run's directory is its own (a new launch refuses one that exists): start it, stop it,
    # put its rollouter's state on a small disk, and go on with `--resume`.
    proc = launch(run_dir, "--set", f"trainer.total_steps={steps}", "--set", "rollout.eval_every=0")
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 3, 300, "training under way", proc)
    finally:
        proc.send_signal(signal.SIGINT)
        finish(proc)
    disk = run_dir / "rollouter"
    saved = tmp_path / "saved"
    shutil.copytree(disk, saved)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or 'not root'})")
    log = run_dir / "logs" / "rollouter-0.log"
    try:
        shutil.copytree(saved, disk, dirs_exist_ok=True)
        before = log.read_text().count('"journal_write_failed"') if log.exists() else 0
        proc = subprocess.Popen([sys.executable, "-m", "rollmesh", "launch", "--resume",
                                 str(run_dir), "--quiet"], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            wait_for(lambda: len(metrics(run_dir)) >= 8, 300, "training after the resume",
                     proc)
            ballast = fill(disk)
            wait_for(lambda: log.read_text().count('"journal_write_failed"') > before, 120,
                     "the rollouter's journal write to fail", proc)
            time.sleep(2.0)  # a restart or two meet the full disk as well
            ballast.unlink()
        finally:
            out = finish(proc)
        assert proc.returncode == 0, out[-3000:]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert_nothing_trained_twice(rows)
    check_accounting(run_dir)
    text = log.read_text()
    assert f"{disk / 'rollouter.log'}" in text and "No space left on device" in text
    status = json.loads((run_dir / "status.json").read_text())
    rollouter = next(p for p in status["processes"] if p["name"] == "rollouter[0]")
    assert rollouter["restarts"] >= 1, rollouter
