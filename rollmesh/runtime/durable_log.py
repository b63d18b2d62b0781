"""An append-only log of checksummed records in one file: the MessageQueue's durable state.

File layout, in one of two versions:

    MAGIC (8 bytes: b"RMQLOG01")                        a log written as one file from the start
    record*       record := length (u32 LE) | crc32 of payload (u32 LE) | payload (length bytes)

    MAGIC_SALTED (8 bytes: b"RMQLOG02") | salt (u32 LE) | crc32 of the 12 bytes before (u32 LE)
    record*       the same, but the stored checksum is crc32(payload) XOR salt

A salted file is one that a compaction wrote into a recycled file (`recycle=True`, below): the
bytes past its last record may be records of the file's earlier lives, whole and checksummed
under their own salt. The salt (each compaction's one more than the last) makes them fail the
check, so a replay stops where this life's records end, exactly as at a torn tail. An
unsalted log reads as salt 0 (crc32 XOR 0 is crc32): both versions replay.

The payload is opaque here (the MessageQueue writes msgpack entries whose groups are the wire
codec's frames, never pickle). Reading stops at the first record that is incomplete or whose
checksum does not match: that is the torn tail a kill -9 or a machine crash can leave; it is
logged, cut off (the file is truncated to the last whole record) and appending continues from
there. It is never fatal. A file that does not start with MAGIC is refused (not ours).

Durability (`fsync_interval_s`):
- every `append` hands the whole record to the kernel (`os.write`) before it returns, so the
  caller may acknowledge afterwards: a process crash (kill -9, OOM kill) loses nothing
  acknowledged; `append_records` does so for several records with one `writev`;
- `fsync` is batched: at most `fsync_interval_s` after a record was written (on the next append,
  or on the owner's periodic `sync()`, or `begin_sync`/`end_sync` around an fsync the owner runs
  in another thread while appends go on), so a machine crash or power cut loses at most the
  last `fsync_interval_s` of acknowledged records, and the replay sees a whole prefix of the log.
  `fsync_interval_s = 0` fsyncs every record before `append` returns (nothing acknowledged is
  lost even to a machine crash; each put then costs a disk flush).
- A failed write (disk full: ENOSPC, or EFBIG past a file size limit) is cut back off the file,
  so later records are never hidden behind a half-written one; the error (an OSError naming the
  file) goes to the caller, which must not acknowledge. Once space returns, the next append
  simply works: the file holds whole records only. A failed fsync raises too (naming the file):
  what the kernel held may not be on disk, so the owner should stop and replay the file.
- A failed compaction (`rewrite`: no room for the new file) leaves the log as it was.

Recycling (`recycle=True`, the MessageQueue's log): writing into pages the kernel must first
allocate (and later free, when a compacted log is deleted) costs about three times what
writing over pages it already caches does. So a compaction keeps the log it replaces as a
spare (`<log>.compact`, under a second hard link while the new one is renamed in, so the log's
name always holds a whole log) and the next compaction writes into the spare from its start,
salted: the new log reuses the spare's pages, and appends go on over the rest of them. The file
is then longer than its records until appends pass its old end; `close` cuts it back and
deletes the spare (a leftover spare is deleted on open). Disk use: the log, plus a spare no
larger than a log was before its compaction.

Compaction: `rewrite(payloads)` writes the live records to a temporary file beside the log,
fsyncs it, renames it over the log and fsyncs the directory: a crash at any moment leaves either
the old log or the new one, whole. When to compact is the owner's rule (MessageQueue: when the
file exceeds max(2 x live bytes, a floor)).
"""

from __future__ import annotations

import os
import struct
import time
import uuid
import zlib
from pathlib import Path
from typing import Any, Iterable

MAGIC = b"RMQLOG01"
MAGIC_SALTED = b"RMQLOG02"
HEADER = struct.Struct("<II")  # payload length, crc32(payload) (XOR the file's salt)
SALT_HEADER = struct.Struct("<8sII")  # MAGIC_SALTED, salt, crc32 of the 12 bytes before
MAX_RECORD_BYTES = 1 << 31


class LogFormatError(RuntimeError):
    """The file is not a rollmesh log (wrong magic): refused rather than overwritten."""


def header(payload: bytes) -> bytes:
    """The header of the record holding this payload."""
    if len(payload) >= MAX_RECORD_BYTES:
        raise ValueError(f"log record of {len(payload)} bytes exceeds {MAX_RECORD_BYTES}")
    return HEADER.pack(len(payload), zlib.crc32(payload))


def frame(payload: bytes) -> bytes:
    """One record as it lies on disk."""
    return header(payload) + payload


def record_size(header: bytes) -> int:
    """The bytes on disk of the record with this header."""
    return HEADER.size + HEADER.unpack(header)[0]


def salted(head: bytes, salt: int) -> bytes:
    """A record header with its stored checksum XORed with `salt` (moved from one file's salt
    to another's: XOR both)."""
    if not salt:
        return head
    length, crc = HEADER.unpack(head)
    return HEADER.pack(length, crc ^ salt)


def salt_header(salt: int) -> bytes:
    """The first bytes of a salted log."""
    head = MAGIC_SALTED + salt.to_bytes(4, "little")
    return head + zlib.crc32(head).to_bytes(4, "little")


def scan(data: bytes | memoryview, start: int = len(MAGIC),
         salt: int = 0) -> tuple[list[memoryview], int]:
    """The whole records of a log image (from `start`, after the file's header) whose checksums
    match under `salt`, and the offset where they end."""
    view = memoryview(data)
    records = []
    offset = start
    end = len(view)
    while offset + HEADER.size <= end:
        length, crc = HEADER.unpack_from(view, offset)
        start = offset + HEADER.size
        if start + length > end:
            break
        payload = view[start:start + length]
        if zlib.crc32(payload) ^ salt != crc:
            break
        records.append(payload)
        offset = start + length
    return records, offset


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in directory `path` survive a machine crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str, fsync: bool = True, mode: int = 0o666) -> None:
    """Replace `path` whole (a temporary file beside it, renamed over it): a reader sees the old
    text or the new, never half of one. `fsync`: the new text is on disk before the rename (a
    checkpoint's pointer); without it, only readers are protected (status files rewritten every
    second). `mode`: the file's permissions (less the umask), from its creation on."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "w") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


class DurableLog:
    """Open with `DurableLog.open(path)`, which also returns the records already there."""

    def __init__(self, path: Path, fd: int, size: int, fsync_interval_s: float, log=None,
                 salt: int = 0, recycle: bool = False):
        self.path = path
        self._fd: int | None = fd
        self.size = size  # where this life's records end (the file may be longer: recycled)
        self.salt = salt  # XORed into every record's checksum (0: an unsalted log)
        self.recycle = recycle
        self._spare: Path | None = None  # the log before the last compaction, for the next
        self.fsync_interval_s = fsync_interval_s
        self.log = log
        self.dirty = False
        self.last_sync = time.monotonic()
        # The owner fsyncs from another thread (`begin_sync` / `end_sync`) every
        # fsync_interval_s: appends never wait for a disk flush (unless fsync_interval_s is 0).
        self.background_sync = False
        self.appended_records = 0
        self.fsyncs = 0
        self.compactions = 0
        self.discarded_bytes = 0  # torn tail cut off at open

    @classmethod
    def open(cls, path: str | Path, *, fsync_interval_s: float = 1.0, log=None,
             recycle: bool = False) -> tuple[DurableLog, list[bytes]]:
        """`recycle`: compactions reuse the file they replace (see the module doc)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        for leftover in (path.with_name(path.name + ".compact"),
                         path.with_name(path.name + ".old")):
            # a compaction that did not finish, or a spare: the log itself is whole
            leftover.unlink(missing_ok=True)
        created = not path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            data = b""
            salt = 0
            size = os.fstat(fd).st_size
            if size:
                with open(path, "rb") as f:
                    data = f.read()
            if len(data) < len(MAGIC) and MAGIC.startswith(data):
                records, good = [], len(MAGIC)  # new, or torn while being created
                os.ftruncate(fd, 0)
                os.write(fd, MAGIC)
                os.fsync(fd)
                discarded = 0
            elif data.startswith(MAGIC_SALTED):
                if len(data) < SALT_HEADER.size or \
                        zlib.crc32(data[:SALT_HEADER.size - 4]) != SALT_HEADER.unpack_from(data)[2]:
                    raise LogFormatError(f"{path}: the header of a salted rollmesh queue log "
                                         f"is damaged ({bytes(data[:SALT_HEADER.size])!r})")
                salt = SALT_HEADER.unpack_from(data)[1]
                views, good = scan(data, SALT_HEADER.size, salt)
                records = [bytes(v) for v in views]
                discarded = len(data) - good
                if discarded:
                    os.ftruncate(fd, good)
                    os.fsync(fd)
            elif not data.startswith(MAGIC):
                raise LogFormatError(f"{path} is not a rollmesh queue log "
                                     f"(starts with {bytes(data[:8])!r})")
            else:
                views, good = scan(data)
                records = [bytes(v) for v in views]
                discarded = len(data) - good
                if discarded:
                    os.ftruncate(fd, good)
                    os.fsync(fd)
            os.lseek(fd, 0, os.SEEK_END)
        except BaseException:
            os.close(fd)
            raise
        if created:
            fsync_dir(path.parent)
        self = cls(path, fd, good, fsync_interval_s, log, salt=salt, recycle=recycle)
        self.discarded_bytes = discarded
        if discarded and log is not None:
            log.warning("log_torn_tail", path=str(path), kept_bytes=good,
                        discarded_bytes=discarded, records=len(records))
        return self, records

    # -- writing ---------------------------------------------------------------------------

    def append(self, payload: bytes) -> int:
        """Write one record (in the kernel when this returns); its size on disk."""
        return self.append_parts([payload])

    def append_parts(self, parts: list[Any]) -> int:
        """Write one record whose payload is these buffers back to back, without joining them
        (a queued group's arrays go from the received frames to the file with no copy)."""
        return record_size(self.append_records([parts])[0])

    def append_records(self, records: list[list[Any]]) -> list[bytes]:
        """Write several records (each a payload in parts, as `append_parts`) with one system
        call where it can, all in the kernel when this returns, then fsync at most once.
        Returns each record's header (length, crc32): `rewrite` can write the record again
        without reading its bytes. A failure writes none of them (the file is cut back)."""
        assert self._fd is not None, "log is closed"
        headers: list[bytes] = []
        pending: list[memoryview] = []
        for parts in records:
            views = [memoryview(p).cast("B") for p in parts]
            length = sum(v.nbytes for v in views)
            if length >= MAX_RECORD_BYTES:
                raise ValueError(f"log record of {length} bytes exceeds {MAX_RECORD_BYTES}")
            crc = 0
            for v in views:
                crc = zlib.crc32(v, crc)
            header = HEADER.pack(length, crc ^ self.salt)
            headers.append(header)
            pending.append(memoryview(header))
            pending += (v for v in views if v.nbytes)
        self._write(pending)
        self.size += sum(map(record_size, headers))
        self.appended_records += len(records)
        self.dirty = True
        if self.fsync_interval_s <= 0 or (
                not self.background_sync
                and time.monotonic() - self.last_sync >= self.fsync_interval_s):
            self.sync()
        return headers

    def _write(self, pending: list[memoryview]) -> None:
        """writev everything at the end of the file, or nothing (cut back on a failure)."""
        try:
            i = 0
            while i < len(pending):
                n = os.writev(self._fd, pending[i:i + 1024])  # IOV_MAX
                while n:
                    if n >= pending[i].nbytes:
                        n -= pending[i].nbytes
                        i += 1
                    else:
                        pending[i] = pending[i][n:]
                        n = 0
        except BaseException as e:
            os.ftruncate(self._fd, self.size)  # never leave a half record before later ones
            os.lseek(self._fd, 0, os.SEEK_END)
            if isinstance(e, OSError) and e.filename is None:  # name the file (disk full...)
                raise OSError(e.errno, e.strerror, str(self.path)) from None
            raise

    def sync(self) -> None:
        """fsync if anything was written since the last one."""
        if self._fd is not None and self.dirty:
            try:
                os.fsync(self._fd)
            except OSError as e:
                raise OSError(e.errno, f"fsync failed: {e.strerror}", str(self.path)) from None
            self.fsyncs += 1
            self.dirty = False
        self.last_sync = time.monotonic()

    def begin_sync(self) -> tuple[int, int] | None:
        """For an fsync in another thread, while appends go on: a duplicate of the file's
        descriptor to fsync, and the appends it covers; None if nothing needs it. Whatever
        was written before the fsync starts is on disk when it returns (`end_sync`)."""
        if self._fd is None or not self.dirty:
            self.last_sync = time.monotonic()
            return None
        return os.dup(self._fd), self.appended_records

    def end_sync(self, started: tuple[int, int], error: OSError | None = None) -> None:
        """After the fsync of `begin_sync`'s descriptor (or its `error`: raised, naming the
        file). A compaction in between is harmless: the new file was fsynced whole."""
        fd, appended = started
        os.close(fd)
        if error is not None:
            raise OSError(error.errno, f"fsync failed: {error.strerror}", str(self.path))
        self.fsyncs += 1
        self.last_sync = time.monotonic()
        if self.appended_records == appended:
            self.dirty = False

    def rewrite(self, records: Iterable[bytes | tuple[bytes, list[Any]]]) -> list[bytes]:
        """Replace the log by exactly these records (atomically, durably). A record is its
        payload, or (header, payload parts) as `append_records` wrote it before: written again
        as it is, without computing its checksum again (moved to the new file's salt by an
        XOR). Returns every record's header.

        `recycle`: the new log is written salted into the spare (the log the last compaction
        replaced: its pages are cached), and the log it replaces becomes the next spare."""
        assert self._fd is not None, "log is closed"
        tmp = self.path.with_name(self.path.name + ".compact")
        reuse = self.recycle and self._spare is not None and tmp.exists()
        salt = ((self.salt + 1) & 0xFFFFFFFF or 1) if self.recycle else 0
        moved = self.salt ^ salt  # XOR into a kept header: its checksum under the new salt
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | (0 if reuse else os.O_TRUNC), 0o600)
        size = 0
        headers: list[bytes] = []
        try:
            with os.fdopen(fd, "wb", buffering=1 << 20, closefd=False) as f:
                head = salt_header(salt) if self.recycle else MAGIC
                f.write(head)
                size += len(head)
                for r in records:
                    if isinstance(r, tuple):
                        head, parts = r
                        head = salted(head, moved)
                        f.write(head)
                        for part in parts:
                            f.write(part)
                    else:
                        head = salted(header(r), salt)
                        f.write(head)
                        f.write(r)
                    headers.append(head)
                    size += record_size(head)
            os.fsync(fd)
        except BaseException as e:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            self._spare = None
            if isinstance(e, OSError) and e.filename is None:
                raise OSError(e.errno, e.strerror, str(tmp)) from None
            raise
        os.close(fd)
        spare = None
        if self.recycle:
            # the log being replaced keeps a second name, so that it survives the rename as
            # the next spare (the log's own name holds a whole log at every moment)
            spare = self.path.with_name(self.path.name + ".old")
            try:
                spare.unlink(missing_ok=True)
                os.link(self.path, spare)
            except OSError:  # no hard links here: the old log is simply deleted
                spare = None
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)
        self._spare = None
        if spare is not None:
            try:
                os.replace(spare, tmp)
                self._spare = tmp
            except OSError:
                spare.unlink(missing_ok=True)
        before = self.size
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR)
        os.lseek(self._fd, size, os.SEEK_SET)  # a recycled file goes on past its records
        self.size = size
        self.salt = salt
        self.dirty = False
        self.last_sync = time.monotonic()
        self.compactions += 1
        if self.log is not None:
            self.log.info("log_compacted", path=str(self.path), before_bytes=before,
                          after_bytes=size, recycled=reuse)
        return headers

    def close(self) -> None:
        """Sync and close; a recycled file is cut back to its records, the spare deleted."""
        if self._fd is not None:
            if self.recycle and os.fstat(self._fd).st_size > self.size:
                os.ftruncate(self._fd, self.size)
                self.dirty = True
            self.sync()
            os.close(self._fd)
            self._fd = None
        if self._spare is not None:
            self._spare.unlink(missing_ok=True)
            self._spare = None

    @property
    def closed(self) -> bool:
        return self._fd is None
