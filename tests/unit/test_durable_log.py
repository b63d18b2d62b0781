"""The append-only log under the MessageQueue: framing, replay, torn tails, atomic rewrite."""

from __future__ import annotations

import os
import struct
import time
import zlib

import pytest

from rollmesh.runtime.durable_log import HEADER, MAGIC, DurableLog, LogFormatError


def payloads(n: int) -> list[bytes]:
    return [f"record {i} ".encode() * (i % 7 + 1) for i in range(n)]


def write(path, records, **kw) -> DurableLog:
    log, existing = DurableLog.open(path, **kw)
    assert existing == []
    for p in records:
        log.append(p)
    return log


def test_records_come_back_in_order_after_reopening(tmp_path):
    path = tmp_path / "q.log"
    records = payloads(50) + [b""]  # an empty payload is a record too
    write(path, records).close()
    assert path.read_bytes().startswith(MAGIC)
    log, got = DurableLog.open(path)
    assert got == records and log.size == path.stat().st_size and log.discarded_bytes == 0
    log.append(b"one more")
    log.close()
    assert DurableLog.open(path)[1] == records + [b"one more"]


@pytest.mark.parametrize("cut", ["in_header", "in_payload", "bad_checksum", "length_past_end"])
def test_a_torn_last_record_is_discarded_and_appending_goes_on(tmp_path, cut):
    path = tmp_path / "q.log"
    records = payloads(10)
    write(path, records).close()
    whole = path.read_bytes()
    last = HEADER.size + len(records[-1])
    if cut == "in_header":
        data = whole[:-last + 3]
    elif cut == "in_payload":
        data = whole[:-5]
    elif cut == "bad_checksum":
        data = whole[:-1] + bytes([whole[-1] ^ 0xFF])
    else:  # a header claiming more bytes than the file holds
        start = len(whole) - last
        data = whole[:start] + struct.pack("<II", 1 << 30, 0) + whole[start + HEADER.size:]
    path.write_bytes(data)

    log, got = DurableLog.open(path)
    assert got == records[:-1]
    assert log.discarded_bytes == len(data) - (len(whole) - last)
    assert path.stat().st_size == len(whole) - last  # cut back to the last whole record
    log.append(b"after the tear")
    log.close()
    assert DurableLog.open(path)[1] == records[:-1] + [b"after the tear"]


def test_an_empty_or_half_created_file_is_a_new_log_and_a_foreign_file_is_refused(tmp_path):
    half = tmp_path / "half.log"
    half.write_bytes(MAGIC[:3])  # killed while writing the magic
    log, got = DurableLog.open(half)
    assert got == [] and half.read_bytes() == MAGIC
    log.close()
    foreign = tmp_path / "foreign.log"
    foreign.write_bytes(b"not a rollmesh log at all")
    with pytest.raises(LogFormatError, match="not a rollmesh queue log"):
        DurableLog.open(foreign)
    assert foreign.read_bytes() == b"not a rollmesh log at all"  # left as it was


def test_rewrite_replaces_the_log_whole_and_a_leftover_temporary_is_ignored(tmp_path):
    path = tmp_path / "q.log"
    log = write(path, payloads(100))
    log.rewrite([b"live 1", b"live 2"])
    log.append(b"after")
    assert log.size == path.stat().st_size
    log.close()
    assert DurableLog.open(path)[1] == [b"live 1", b"live 2", b"after"]
    # a compaction killed half way leaves its temporary beside an intact log
    (tmp_path / "q.log.compact").write_bytes(MAGIC + b"\x05\x00")
    log, got = DurableLog.open(path)
    assert got == [b"live 1", b"live 2", b"after"]
    assert not (tmp_path / "q.log.compact").exists()
    log.close()


def test_fsync_every_record_or_batched(tmp_path):
    every = write(tmp_path / "a.log", payloads(20), fsync_interval_s=0)
    assert every.fsyncs == 20 and not every.dirty
    every.close()
    batched = write(tmp_path / "b.log", payloads(20), fsync_interval_s=3600)
    assert batched.fsyncs == 0 and batched.dirty  # in the kernel, not yet on the disk
    batched.sync()
    assert batched.fsyncs == 1 and not batched.dirty
    batched.close()
    assert DurableLog.open(tmp_path / "b.log")[1] == payloads(20)


def test_a_failed_write_leaves_no_partial_record_behind(tmp_path, monkeypatch):
    path = tmp_path / "q.log"
    log = write(path, payloads(3))
    size = log.size
    real = os.writev
    calls = []

    def half_then_fail(fd, buffers):
        calls.append(len(buffers))
        if len(calls) == 1:
            return real(fd, [b"".join(bytes(b) for b in buffers)[:7]])  # a short write ...
        raise OSError(28, "No space left on device")  # ... then the disk is full

    monkeypatch.setattr(os, "writev", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        log.append(b"x" * 100)
    monkeypatch.setattr(os, "writev", real)
    assert log.size == size == path.stat().st_size
    log.append(b"fits")
    log.close()
    assert DurableLog.open(path)[1] == payloads(3) + [b"fits"]


def test_a_record_written_in_pieces_reads_back_as_one(tmp_path):
    """The queue writes a put as msgpack pieces and the group's array frames, uncopied."""
    import numpy as np

    path = tmp_path / "q.log"
    log, _ = DurableLog.open(path)
    arr = np.arange(1000, dtype=np.int32)
    pieces = [b"head", memoryview(arr), b"", memoryview(arr[::-1].copy()), b"tail"]
    size = log.append_parts(pieces)
    log.close()
    joined = b"head" + arr.tobytes() + arr[::-1].tobytes() + b"tail"
    assert size == 8 + len(joined) and path.stat().st_size == len(MAGIC) + size
    assert DurableLog.open(path)[1] == [joined]


def test_a_file_size_limit_fails_the_append_naming_the_file_and_leaves_whole_records(tmp_path):
    """RLIMIT_FSIZE (SIGXFSZ ignored) in a child: a write past it fails with EFBIG part-way
    through a record; the part written is cut off, the error names the file, and the file
    reopens with every whole record and nothing torn."""
    import subprocess
    import sys

    path = tmp_path / "q.log"
    script = f"""
import errno, resource, signal
from rollmesh.runtime.durable_log import DurableLog
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, 10_000))
log, _ = DurableLog.open({str(path)!r}, fsync_interval_s=0)
n = 0
try:
    while True:
        log.append(bytes([n % 256]) * 1000)
        n += 1
except OSError as e:
    assert e.errno == errno.EFBIG, e
    print(n, log.size, str(e))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr
    n, size, error = out.stdout.strip().split(" ", 2)
    assert int(n) == (10_000 - len(MAGIC)) // 1008
    assert error == f"[Errno 27] File too large: '{path}'"
    assert path.stat().st_size == int(size)  # the partial record was cut back off
    log, records = DurableLog.open(path)
    assert log.discarded_bytes == 0 and records == [bytes([i]) * 1000 for i in range(int(n))]
    log.append(b"after")  # room again (no limit here): appending goes on
    log.close()
    assert DurableLog.open(path)[1][-1] == b"after"


def test_several_records_in_one_write_all_in_the_kernel_or_none(tmp_path, monkeypatch):
    path = tmp_path / "q.log"
    log, _ = DurableLog.open(path, fsync_interval_s=3600)
    calls = []
    real = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, b: calls.append(len(b)) or real(fd, b))
    headers = log.append_records([[b"one"], [b"tw", b"o"], [b""]])
    assert len(calls) == 1 and log.appended_records == 3
    # in the file (the kernel) when it returns, before any fsync: another reader sees them
    assert DurableLog.open(path)[1] == [b"one", b"two", b""] and log.fsyncs == 0
    assert [HEADER.unpack(h)[0] for h in headers] == [3, 3, 0]

    def fail(fd, buffers):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "writev", fail)
    with pytest.raises(OSError, match="No space left.*q.log"):
        log.append_records([[b"four"], [b"five"]])
    monkeypatch.setattr(os, "writev", real)
    assert log.appended_records == 3 and log.size == path.stat().st_size
    log.close()
    assert DurableLog.open(path)[1] == [b"one", b"two", b""]


def test_an_fsync_in_another_thread_covers_what_was_written_before_it_began(tmp_path):
    log, _ = DurableLog.open(tmp_path / "q.log", fsync_interval_s=0.001)
    log.background_sync = True  # the owner fsyncs: appends never wait for the disk
    log.append(b"a")
    time.sleep(0.01)
    log.append(b"b")
    assert log.fsyncs == 0 and log.dirty
    started = log.begin_sync()
    log.append(b"c")  # written while the fsync runs: not covered by it
    os.fsync(started[0])
    log.end_sync(started)
    assert log.fsyncs == 1 and log.dirty  # "c" still needs one
    started = log.begin_sync()
    os.fsync(started[0])
    log.end_sync(started)
    assert log.fsyncs == 2 and not log.dirty
    assert log.begin_sync() is None  # nothing new: nothing to do
    started = log.begin_sync() if log.append(b"d") else None
    with pytest.raises(OSError, match="fsync failed: Input/output error.*q.log"):
        log.end_sync(started, OSError(5, "Input/output error"))
    log.close()
    # fsync_interval_s = 0 fsyncs every record before it returns, background or not
    every, _ = DurableLog.open(tmp_path / "e.log", fsync_interval_s=0)
    every.background_sync = True
    every.append_records([[b"x"], [b"y"]])
    assert every.fsyncs == 1 and not every.dirty
    every.close()


def crashed_copy(path, tmp_path):
    """The file as a kill -9 would leave it (no close): copied while the log is open."""
    copy = tmp_path / "crashed" / path.name
    copy.parent.mkdir(exist_ok=True)
    copy.write_bytes(path.read_bytes())
    return copy


def test_a_recycled_log_never_replays_the_records_of_its_earlier_life(tmp_path):
    """recycle=True: the second compaction writes the new log, salted, over the file the first
    one replaced. A record of this life ending exactly where a whole record of the file's
    earlier life begins: a kill there replays this life's records only."""
    from rollmesh.runtime.durable_log import MAGIC_SALTED, SALT_HEADER

    path = tmp_path / "q.log"
    log, _ = DurableLog.open(path, recycle=True)
    old = [bytes([i]) * 100 for i in range(20)]  # records of 108 bytes, from offset 8
    for p in old:
        log.append(p)
    log.rewrite([])  # a new file (no spare yet); the old one is kept as the spare
    assert (tmp_path / "q.log.compact").stat().st_size == len(MAGIC) + 20 * 108
    log.append(b"second life")
    log.rewrite([])  # written over the spare, from its start
    assert path.read_bytes().startswith(MAGIC_SALTED) and log.salt == 2
    assert log.size == SALT_HEADER.size and path.stat().st_size == len(MAGIC) + 20 * 108
    new = b"n" * 92  # 16 + 100 = 116 = 8 + 108: the earlier life's second record starts here
    log.append(new)
    assert path.read_bytes()[116:116 + 108] == HEADER.pack(100, zlib.crc32(old[1])) + old[1]
    copy = crashed_copy(path, tmp_path)
    again, got = DurableLog.open(copy)
    assert got == [new]  # not old[1:]: its checksum does not hold under this file's salt
    assert again.discarded_bytes == 19 * 108 and copy.stat().st_size == 116
    again.append(b"after")
    again.close()
    assert DurableLog.open(copy)[1] == [new, b"after"]
    log.close()  # a clean close: the file cut back to its records, the spare deleted
    assert path.stat().st_size == log.size == 116
    assert not (tmp_path / "q.log.compact").exists()
    reopened, got = DurableLog.open(path)
    assert got == [new] and reopened.discarded_bytes == 0 and reopened.salt == 2
    reopened.close()


def test_recycled_compactions_keep_the_records_and_their_kept_headers(tmp_path):
    """Records written again from their kept headers (checksums moved to the new salt by an
    XOR, not computed again) replay whole, compaction after compaction, killed or closed."""
    path = tmp_path / "q.log"
    log, _ = DurableLog.open(path, recycle=True)
    kept = [(log.append_records([[p]])[0], p) for p in payloads(30)]
    for round in range(5):
        for i in range(200):
            log.append(b"garbage %d" % i * 50)
        headers = log.rewrite([(h, [p]) for h, p in kept] + [b"counters %d" % round])
        kept = list(zip(headers[:-1], (p for _, p in kept)))
        assert log.salt == round + 1
        got = DurableLog.open(crashed_copy(path, tmp_path))[1]
        assert got == [p for _, p in kept] + [b"counters %d" % round]
    assert log.compactions == 5 and path.stat().st_size > log.size  # pages kept for appends
    log.close()
    again, got = DurableLog.open(path)
    assert got == [p for _, p in kept] + [b"counters 4"] and again.discarded_bytes == 0
    again.close()


def test_an_unsalted_log_replays_and_a_damaged_salted_header_is_refused(tmp_path):
    path = tmp_path / "q.log"
    write(path, payloads(5)).close()  # RMQLOG01, as every log before recycling
    log, got = DurableLog.open(path, recycle=True)
    assert got == payloads(5) and log.salt == 0
    log.rewrite(got)
    log.append(b"more")
    log.close()
    log, got = DurableLog.open(path)
    assert got == payloads(5) + [b"more"] and log.salt == 1
    log.close()
    data = bytearray(path.read_bytes())
    data[9] ^= 0xFF  # the salt, no longer matching the header's checksum
    path.write_bytes(bytes(data))
    with pytest.raises(LogFormatError, match="header of a salted rollmesh queue log is damaged"):
        DurableLog.open(path)
