"""The rollouter's journal: its records, and the one path that applies them.

Every change to the rollouter's durable state is a record: written first (when the journal has
a file), then applied by `Journal._apply`, the same function a replay runs on the records it
reads back. The counters of the accounting identity (admitted, queued, rejected groups; the
dropped samples by reason) change only there, so a live rollouter and a restarted one count
alike. A rollouter without a state directory keeps its journal in memory (`Journal(None, log)`):
the same records, applied the same way, nothing written.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from rollmesh.rollout.data import PromptGroup
from rollmesh.runtime.durable_log import DurableLog

__all__ = ["Journal", "JournalDiskError", "OpenGroup"]


@dataclass
class OpenGroup:
    row: int  # the dataset row's index
    size: int
    version: int
    dropped: int = 0  # samples already dropped (a dropped group's stragglers come back later)
    done: bool = False  # queued, or dropped as a whole
    queue: int = 0  # the queue shard it goes to (RolloutCore.route)


class JournalDiskError(OSError):
    """The rollouter's journal could not be written (disk full...): the change did not happen."""


class Journal:
    """The rollouter's state on disk, so that a restarted rollouter (kill -9, or
    `rollmesh launch --resume`) goes on where this one stood: an append-only log
    (`rollmesh.runtime.durable_log`) of msgpack records

        admit   group id, row, size, version, the prompt cursor after it, the queue shard
                it goes to (absent: 0)
        queued  group id (the MessageQueue accepted it)
        drop    group id, reason, samples
        pause   a Pause arrived (the synchronizer is about to broadcast)
        version a Resume: the weight version it brought, and rollout is not paused
        rewind  the trainer resumed at an older version: the version is that one again

    Replayed, it gives the cursor, the counters of the accounting identity and the groups that
    were admitted but neither queued nor dropped: those were in flight in the lost process and
    are generated again from their prompts, under the same group ids, so each is counted once.
    A group queued but not yet journaled as such when the process died is generated again too;
    the MessageQueue drops the second copy by its group id. Compaction: past `compact_bytes` the
    log is rewritten as one snapshot record (cursor, version, counters, the open groups).

    Without a path the journal lives in memory: nothing is written, nothing replayed, and the
    records are applied all the same (the live counters).

    `paused` is whether the last word of the synchronizer was a Pause: a rollouter restarted
    in the middle of a weight sync must not generate until that sync's Resume reaches it.
    """

    def __init__(self, path: str | Path | None, log: Any, compact_bytes: int = 8 << 20):
        self.file: DurableLog | None = None  # None: in memory only
        records: list[bytes] = []
        if path is not None:
            self.file, records = DurableLog.open(path, fsync_interval_s=1.0, log=log)
        if log is None:
            from rollmesh.runtime.log import get_logger
            log = get_logger("rollmesh.rollout.role")
        self.log = log
        self.error: str | None = None  # the last failed write
        self._compact_after = 0.0
        self.compact_bytes = compact_bytes
        self.cursor: dict[str, Any] | None = None
        self.version = 0
        self.paused = False
        self.counters: collections.Counter[str] = collections.Counter()
        self.dropped: collections.Counter[str] = collections.Counter()
        self.groups: dict[str, OpenGroup] = {}
        for raw in records:
            self._apply(msgpack.unpackb(raw, raw=False))
        self.replayed = len(records)

    def _apply(self, r: dict[str, Any]) -> None:
        kind = r["k"]
        if kind == "snapshot":
            self.cursor, self.version = r["cursor"], r["version"]
            self.paused = r.get("paused", False)
            self.counters = collections.Counter(r["counters"])
            self.dropped = collections.Counter(r["dropped"])
            self.groups = {gid: OpenGroup(*g) for gid, g in r["groups"].items()}
        elif kind == "admit":
            self.groups[r["g"]] = OpenGroup(r["row"], r["n"], r["v"], queue=r.get("q", 0))
            self.cursor = r["cursor"]
            self.counters["admitted_groups"] += 1
            self.counters["admitted_samples"] += r["n"]
        elif kind == "queued":
            self.groups.pop(r["g"], None)
            self.counters["accepted_groups"] += 1
            self.counters["queued_groups"] += 1
            self.counters["queued_samples"] += r["n"]
        elif kind == "drop":
            self.dropped[r["reason"]] += r["n"]
            g = self.groups.get(r["g"])
            if g is not None:
                g.dropped += r["n"]
                if r.get("whole"):
                    g.done = True
                    self.counters["rejected_groups"] += 1
                if g.done and g.dropped >= g.size:
                    del self.groups[r["g"]]
        elif kind == "pause":
            self.paused = True
        elif kind == "version":
            self.version = max(self.version, r["v"])
            self.paused = False
        elif kind == "rewind":  # the trainer went back to an older version (`rewound`)
            self.version = r["v"]

    def _write(self, record: dict[str, Any]) -> None:
        """Write-ahead: on disk (in the kernel) first, then applied. A write that fails (disk
        full, file size limit) is cut back off the file and changes nothing here; it raises
        JournalDiskError naming the file, which stops the rollouter (the launcher restarts it,
        and the replay starts from the whole records on disk; nothing was acknowledged that
        is not in them). A failed compaction only leaves the log longer. In memory: applied."""
        if self.file is None:
            self._apply(record)
            return
        try:
            self.file.append(msgpack.packb(record, use_bin_type=True))
        except OSError as e:
            self.error = f"{e.filename or self.file.path}: {e.strerror}"
            self.log.error("journal_write_failed", path=str(self.file.path), error=str(e),
                           record=record["k"])
            raise JournalDiskError(f"rollouter cannot write its journal {self.file.path}: "
                                   f"{e.strerror}") from None
        self._apply(record)
        if self.file.size > self.compact_bytes and time.monotonic() >= self._compact_after:
            try:
                self.compact()
            except OSError as e:
                self._compact_after = time.monotonic() + 30.0
                self.log.warning("journal_compaction_failed", path=str(self.file.path),
                                 error=str(e), retry_in_s=30)

    def admitted(self, group: PromptGroup, cursor: dict[str, Any], version: int,
                 queue: int = 0) -> None:
        record = {"k": "admit", "g": group.group_id, "row": group.row.index,
                  "n": group.group_size, "v": version, "cursor": cursor}
        if queue:
            record["q"] = queue
        self._write(record)

    def queued(self, group_id: str, samples: int) -> None:
        self._write({"k": "queued", "g": group_id, "n": samples})

    def drop(self, group_id: str, reason: str, samples: int, whole: bool = False) -> None:
        if samples or whole:
            self._write({"k": "drop", "g": group_id, "reason": reason, "n": samples,
                         "whole": whole})

    def new_version(self, version: int) -> None:
        """A Resume at `version` (a failed sync resumes at the version it had)."""
        if version > self.version or self.paused:
            self._write({"k": "version", "v": version})

    def rewound(self, version: int) -> None:
        """The trainer resumed at `version`, older than this one (`RolloutCore.rewind`)."""
        if version != self.version:
            self._write({"k": "rewind", "v": version})

    def pause(self) -> None:
        if not self.paused:
            self._write({"k": "pause"})

    def recover(self) -> tuple[list[tuple[str, OpenGroup]], int]:
        """After a replay: the open groups to generate again, and the samples of dropped
        groups that were still out with workers in the lost process (now dropped for good)."""
        lost = 0
        for gid, g in list(self.groups.items()):
            if g.done:  # dropped whole; its stragglers died with the old process
                lost += g.size - g.dropped
                self.drop(gid, "group_failed", g.size - g.dropped)
                self.groups.pop(gid, None)
        return [(gid, g) for gid, g in self.groups.items()], lost

    def compact(self) -> None:
        """Rewrite the log as one snapshot of everything a replay would build."""
        snapshot = {"k": "snapshot", "cursor": self.cursor, "version": self.version,
                    "paused": self.paused,
                    "counters": dict(self.counters), "dropped": dict(self.dropped),
                    "groups": {gid: [g.row, g.size, g.version, g.dropped, g.done, g.queue]
                               for gid, g in self.groups.items()}}
        self.file.rewrite([msgpack.packb(snapshot, use_bin_type=True)])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
