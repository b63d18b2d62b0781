"""End-to-end tests of disk (they start processes); the unit tests and the
helpers they share are in tests/unit/test_disk.py."""

from __future__ import annotations

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
