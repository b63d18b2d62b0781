"""The MessageQueue's state and rules, without sockets (`rollmesh.mq.role` serves them).

It owns the queued groups, the staleness bound at hand-out, and its share of the accounting:
every sample put is eventually consumed or dropped with a reason, and until then it is counted
in `depth` (put = consumed + dropped + depth).

Two ages of a group handed to a trainer at version v, both counted (`staleness_hist`,
`admission_age_hist`): its staleness, v minus the oldest weight version among the group's
generated tokens (`rollmesh.core.trajectory.staleness`, the rule every role applies), and its age
at admission, v minus the version at which the rollouter admitted it (`admission_age`).
`measure` (`staleness.measure`) says which one the bound holds on:

    oldest_token  a group past `max_staleness` is dropped at hand-out and counted (reason
                  "stale"): the bound holds even for trajectories resumed across many syncs.
                  Groups are kept whole (GRPO needs the n samples of a prompt together), so
                  one stale sample drops its group. Hand-out order: the oldest generated first
                  (the group's oldest token version), then put order.
    admission     the rollouter's admission capacity was the bound: nothing is dropped here for
                  its age (dropping the groups that spanned the most syncs drops the longest
                  answers). Hand-out order: the earliest admitted first, then put order.

Durability (role config `state_dir`; without it the queue lives in memory only). Every change
is first appended to `<state_dir>/queue.log` (`rollmesh.runtime.durable_log`: length + crc32 framed
records, torn tail discarded on open), then applied, then acknowledged; on start the log is
replayed, so a MessageQueue killed at any moment comes back with its groups, its hand-outs not
yet committed, its counters (put, consumed, dropped by reason, rejected, staleness histogram) and
its version. Entries are msgpack lists; a group travels as the wire codec's own frames
(`protocol.encode(Group)`), never pickle:

    ["put", seq, [frame, ...]]           a group queued (seq: the queue's own serial)
    ["take", step, version, [seq, ...]]  groups handed out to a trainer at `version` for `step`
                                         (step 0: untracked, gone once handed out)
    ["drop", reason, [seq, ...]]         groups dropped (stale)
    ["commit", committed_step]           hand-outs for steps <= committed_step are forgotten
    ["forget", step]                     one uncommitted hand-out evicted (max_pending_batches)
    ["version", v]                       the weight version
    ["rewind", v]                        the trainer resumed at v, older than the version:
                                         the version is v again, and the queued groups made
                                         after it are dropped ("lost_weights", `rewind`)
    ["state", {counters}]                absolute counters: the last record of a compacted log

Compaction: when the log exceeds max(2 x live bytes, `compact_floor_bytes`) it is rewritten as
the live records only (puts of queued and pending groups, takes of the pending hand-outs, then
the counters), so the log stays within about max(2 x live, floor) + one record. The log is
recycled (`DurableLog` with `recycle=True`): a compaction writes the new log, salted, over the
file the compaction before replaced, and keeps the file it replaces as the next one's spare, so
appends go on over pages the kernel already caches instead of new ones; disk use is the log and
one spare no larger than a log before its compaction.

Hand-out with acknowledgement (issue 9): `hand_out(step, ...)` takes the batch for a trainer
step (state.step + 1), and `commit(committed_step)` says the step of its latest checkpoint. A
batch handed out for a step is kept (durably) until a commit covers that step; a hand-out for a
step already handed out and not yet committed (the trainer restarted from its checkpoint and
opened its stream again) gets exactly the same groups again, counted once. step = 0: a batch
handed out is gone.

The groups a put brings are kept as the frames they came in (`protocol.Framed`): written to the
log and handed out as they are, never encoded again; the header of a put record is kept too, so
a compaction writes the record again without its checksum computed anew.
"""

from __future__ import annotations

import collections
import heapq
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from rollmesh.config import ExperimentConfig
from rollmesh.config.settings import COMPACT_FLOOR_BYTES, MAX_PENDING_BATCHES
from rollmesh.core.trajectory import (
    admission_age, group_origin, is_stale, made_after, oldest_version, staleness,
)
from rollmesh.core.validate import INVALID, invalid_group_reason
from rollmesh.runtime.durable_log import HEADER, DurableLog, record_size
from rollmesh.runtime.log import get_logger
from rollmesh.wire import protocol
from rollmesh.wire.messages import Group

LOG_NAME = "queue.log"
# Drop reasons whose places in the admission bound go back to the rollouter that made the group
# (counted by origin in `stale_by_origin`, answered to every put)
GIVE_BACK = ("stale", "lost_weights", INVALID)
_STATE_OVERHEAD = 4096  # the counters record of a compacted log, roughly


class QueueLogError(RuntimeError):
    """A whole (checksummed) log record that cannot be understood: a format mismatch, fatal."""


class QueueDiskError(OSError):
    """The log could not be written (disk full...): the request changed nothing."""


# -- log entries -------------------------------------------------------------------------------


_SMALL_PART = 4096  # a put record's pieces smaller than this are copied into one


def _array_header(n: int) -> bytes:
    return bytes([0x90 | n]) if n < 16 else (b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16
                                              else b"\xdd" + n.to_bytes(4, "big"))


def _bin_header(n: int) -> bytes:
    return (b"\xc4" + n.to_bytes(1, "big") if n < 1 << 8 else
            b"\xc5" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xc6" + n.to_bytes(4, "big"))


def entry_parts(entry: list[Any]) -> list[Any]:
    """An entry as msgpack, in pieces: a put's group frames are referenced, not copied (the
    log writes the pieces with one writev). A group's frames are the ones it came in, kept
    with it (`protocol.keep_frames`): the same bytes whenever its record is written again."""
    if entry[0] != "put":
        return [msgpack.packb(entry, use_bin_type=True)]
    frames = protocol.keep_frames(entry[2])
    parts: list[Any] = []
    # small pieces (headers, the type name, the body) joined, arrays referenced: fewer
    # pieces to checksum and to hand to writev
    head = bytearray(b"\x93\xa3put" + msgpack.packb(entry[1]) + _array_header(len(frames)))
    for f in frames:
        view = memoryview(f).cast("B")
        head += _bin_header(view.nbytes)
        if view.nbytes < _SMALL_PART:
            head += view
        else:
            parts += [bytes(head), view]
            head.clear()
    if head:
        parts.append(bytes(head))
    return parts


def encode_entry(entry: list[Any]) -> bytes:
    return b"".join(entry_parts(entry))


def _ints(v: Any) -> list[int]:
    if type(v) is not list or not all(type(x) is int for x in v):
        raise QueueLogError(f"expected a list of ints, got {v!r:.80}")
    return v


def decode_entry(payload: bytes) -> list[Any]:
    """Bytes -> a validated entry (groups decoded by the wire codec, strictly)."""
    try:
        e = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=True)
    except Exception as err:
        raise QueueLogError(f"undecodable entry: {type(err).__name__}: {err}") from None
    if type(e) is not list or not e or type(e[0]) is not str:
        raise QueueLogError(f"entry is not [kind, ...]: {e!r:.80}")
    kind, n = e[0], len(e)
    if kind == "put" and n == 3 and type(e[1]) is int and type(e[2]) is list:
        return ["put", e[1], protocol.decode(e[2], Group)]
    if kind == "take" and n == 4 and type(e[1]) is int and type(e[2]) is int:
        return ["take", e[1], e[2], _ints(e[3])]
    if kind == "drop" and n == 3 and type(e[1]) is str:
        return ["drop", e[1], _ints(e[2])]
    if kind == "refuse" and n == 4 and type(e[1]) is str and type(e[2]) is int \
            and type(e[3]) is str:
        return e
    if kind in ("commit", "forget", "version", "rewind") and n == 2 and type(e[1]) is int:
        return e
    if kind == "state" and n == 2 and type(e[1]) is dict:
        return e
    raise QueueLogError(f"unknown or malformed entry {kind!r:.40} ({n} fields)")


@dataclass
class Pending:
    """A batch handed out for a trainer step and not yet covered by a checkpoint."""

    step: int
    version: int
    seqs: list[int]
    groups: list[Group]
    samples: int
    nbytes: int  # its take record on disk


class MessageQueue:
    """The queue's state and rules, without sockets (the role below serves it).

    Every change goes through `_record`: appended to the log (when there is one), then applied
    by the same code that replays the log on start, so live state and replayed state agree."""

    def __init__(self, capacity_groups: int, max_staleness: int, *,
                 measure: str = "admission", state_dir: str | Path | None = None, fsync_interval_s: float = 1.0,
                 compact_floor_bytes: int = COMPACT_FLOOR_BYTES,
                 max_pending_batches: int = MAX_PENDING_BATCHES, log: Any = None):
        self.capacity = capacity_groups
        self.max_staleness = max_staleness
        if measure not in ("admission", "oldest_token"):
            raise ValueError(f"staleness measure: expected 'admission' or 'oldest_token', got "
                             f"{measure!r}")
        self.measure = measure
        self.compact_floor_bytes = compact_floor_bytes
        self.max_pending_batches = max_pending_batches
        self.log = log if log is not None else get_logger("rollmesh.mq.store")
        # seq -> (oldest generated version, group), in put order (= seq order); the oldest
        # version is computed once at put, not at every hand-out
        self.queued: collections.OrderedDict[int, tuple[int | None, Group]] = \
            collections.OrderedDict()
        self.pending: dict[int, Pending] = {}  # step -> the batch handed out for it
        self.depth_samples = 0
        self.version = 0
        self.high_version = 0  # the newest version ever heard, a rewind's lost ones included
        self.committed_step = 0
        self.next_seq = 0
        self.put_samples = 0
        self.consumed_samples = 0
        self.rejected_puts = 0  # back-pressure events: a put refused because the queue was full
        self.duplicate_puts = 0  # a put of a group already held (a retry): accepted, not added
        self.redelivered_batches = 0
        self.evicted_batches = 0
        self.dropped: collections.Counter[str] = collections.Counter()
        # samples dropped as stale or lost_weights (GIVE_BACK) by rollout shard ("<i>", core.trajectory.group_origin)
        self.stale_by_origin: collections.Counter[str] = collections.Counter()
        self.staleness_hist: collections.Counter[int] = collections.Counter()
        self.admission_age_hist: collections.Counter[int] = collections.Counter()
        self._consumed_times: collections.deque[tuple[float, int]] = collections.deque()
        # seq -> the oldest version of a group being put, computed once by `put_many` (which
        # checks it before the write) for `_apply`; a replay computes it again
        self._put_oldest: dict[int, int | None] = {}
        self._live_ids: dict[str, int] = {}  # group_id -> seq, queued or pending
        # every group id ever put: a group the rollouter generated again after a crash (it
        # could not know its first copy was accepted) is recognised even once trained on
        self._seen_ids: set[str] = set()
        self._seen_bytes = 0  # their size in the counters record of a compacted log
        self._clean_at = -1  # every queued group is within the bound at this version
        self._sizes: dict[int, int] = {}  # seq -> its put record's bytes on disk
        # seq -> its put record's header (length, crc32), where known: a compaction writes the
        # record again as it is (its bytes are the group's kept frames, unchanged)
        self._headers: dict[int, bytes] = {}
        self.live_bytes = 0
        self.replayed_records = 0
        self.journal: DurableLog | None = None
        self.log_error: str | None = None  # the last failed log write, until one succeeds
        self.log_write_failures = 0
        self._compact_after = 0.0  # a failed compaction (no room) is retried after this
        if state_dir is not None:
            self.journal, payloads = DurableLog.open(
                Path(state_dir) / LOG_NAME, fsync_interval_s=fsync_interval_s, log=self.log,
                recycle=True)
            for i, payload in enumerate(payloads):
                try:
                    self._apply(decode_entry(payload), len(payload) + HEADER.size)
                except Exception as e:  # whole and checksummed, yet not understood: refuse
                    raise QueueLogError(f"{self.journal.path}: record {i} cannot be replayed: "
                                        f"{type(e).__name__}: {e}") from None
            self.replayed_records = len(payloads)
            self._consumed_times.clear()  # rates are about this process's lifetime
            self._maybe_compact()

    # -- the log -----------------------------------------------------------------------------

    def _record(self, entry: list[Any]) -> Any:
        """Write-ahead: durable (in the kernel) first, then applied. Returns what _apply does."""
        return self._record_many([entry])[0]

    def _record_many(self, entries: list[list[Any]]) -> list[Any]:
        """Several entries written with one write (`DurableLog.append_records`), then applied.

        A write that fails (disk full, file size limit) changes nothing: the log is cut back to
        its last whole record, the state is not touched, the error (naming the file) goes to
        the request's caller, which was not acknowledged and retries; `log_error` in the stats
        (the role's status) says so until a write succeeds again."""
        headers: list[bytes | None] = [None] * len(entries)
        if self.journal is not None:
            try:
                headers = self.journal.append_records([entry_parts(e) for e in entries])
            except OSError as e:
                first = self.log_error is None
                self.log_error = f"{e.filename or self.journal.path}: {e.strerror}"
                self.log_write_failures += 1
                if first:  # once per episode: a full disk fails every request until it clears
                    self.log.error("log_write_failed", path=str(self.journal.path),
                                   error=str(e), record=entries[0][0])
                raise QueueDiskError(
                    f"MessageQueue cannot write its log {self.journal.path}: {e.strerror} "
                    f"(nothing was changed; retry once there is room)") from None
            if self.log_error is not None:
                self.log.warning("log_write_recovered", path=str(self.journal.path),
                                 failed_writes=self.log_write_failures, error=self.log_error)
                self.log_error = None
        out = []
        for entry, header in zip(entries, headers):
            out.append(self._apply(entry, 0 if header is None else record_size(header)))
            if header is not None and entry[0] == "put":
                self._headers[entry[1]] = header
        if self.journal is not None:
            self._maybe_compact()
        return out

    def _apply(self, entry: list[Any], nbytes: int) -> Any:
        kind = entry[0]
        if kind == "put":
            _, seq, group = entry
            k = len(group.trajectories)
            oldest = (self._put_oldest.pop(seq) if seq in self._put_oldest
                      else oldest_version(group, strict=True))
            self.queued[seq] = (oldest, group)
            if self.measure == "oldest_token" and is_stale(oldest, self._clean_at,
                                                           self.max_staleness):
                self._clean_at = -1  # already past the bound at the last scan: scan again
            self._live_ids[group.group_id] = seq
            if group.group_id not in self._seen_ids:
                self._seen_ids.add(group.group_id)
                self._seen_bytes += len(group.group_id) + 2
            self._sizes[seq] = nbytes
            self.live_bytes += nbytes
            self.next_seq = max(self.next_seq, seq + 1)
            self.put_samples += k
            self.depth_samples += k
            return None
        if kind == "take":
            _, step, version, seqs = entry
            taken = [(seq, *self.queued.pop(seq)) for seq in seqs]
            now = time.monotonic()
            samples = 0
            for _seq, oldest, g in taken:
                k = len(g.trajectories)
                samples += k
                self.staleness_hist[staleness(oldest, version)] += k
                self.admission_age_hist[admission_age(g.version_admitted, version)] += k
            self.consumed_samples += samples
            self.depth_samples -= samples
            self._consumed_times.append((now, samples))
            groups = [g for _, _, g in taken]
            if step > 0:
                self.pending[step] = Pending(step, version, list(seqs), groups, samples, nbytes)
                self.live_bytes += nbytes
            else:
                self._forget(seqs, groups)
            return groups
        if kind == "drop":
            _, reason, seqs = entry
            for seq in seqs:
                _, g = self.queued.pop(seq)
                k = len(g.trajectories)
                self.depth_samples -= k
                self.dropped[reason] += k
                if reason in GIVE_BACK:
                    self.stale_by_origin[str(group_origin(g.group_id))] += k
                self._forget([seq], [g])
            return None
        if kind == "refuse":  # a group refused at its put (`put_many`): counted, not kept
            _, gid, k, reason = entry
            self.put_samples += k  # put, then dropped: the queue's own balance holds
            self.dropped[reason] += k
            self.stale_by_origin[str(group_origin(gid))] += k
            if gid not in self._seen_ids:
                self._seen_ids.add(gid)
                self._seen_bytes += len(gid) + 2
            return None
        if kind == "commit":
            self.committed_step = max(self.committed_step, entry[1])
            for step in [s for s in self.pending if s <= self.committed_step]:
                self._release(step)
            return None
        if kind == "forget":
            if entry[1] in self.pending:
                self._release(entry[1])
            return None
        if kind == "version":
            self.version = max(self.version, entry[1])
            self.high_version = max(self.high_version, self.version)
            return None
        if kind == "rewind":
            self.version = entry[1]
            self._clean_at = -1
            return None
        if kind == "state":
            s = entry[1]
            self.version = int(s["version"])
            self.high_version = max(self.version, int(s.get("high_version", 0)))
            self.committed_step = int(s["committed_step"])
            self.next_seq = max(self.next_seq, int(s["next_seq"]))
            self.put_samples = int(s["put_samples"])
            self.consumed_samples = int(s["consumed_samples"])
            self.rejected_puts = int(s["rejected_puts"])
            self.duplicate_puts = int(s.get("duplicate_puts", 0))
            self.evicted_batches = int(s.get("evicted_batches", 0))
            self.dropped = collections.Counter({str(k): int(v) for k, v in s["dropped"].items()})
            self.stale_by_origin = collections.Counter(  # absent in logs before issue 33
                {str(k): int(v) for k, v in s.get("stale_by_origin", {"0": self.dropped["stale"]}
                                                   if self.dropped["stale"] else {}).items()})
            self.staleness_hist = collections.Counter(
                {int(k): int(v) for k, v in s["staleness_hist"].items()})
            self.admission_age_hist = collections.Counter(  # absent in logs before issue 30
                {int(k): int(v) for k, v in s.get("admission_age_hist", {}).items()})
            self.depth_samples = sum(len(g.trajectories) for _, g in self.queued.values())
            for gid in s.get("seen_ids", ()):
                if gid not in self._seen_ids:
                    self._seen_ids.add(gid)
                    self._seen_bytes += len(gid) + 2
            return None
        raise QueueLogError(f"unknown entry {kind!r}")

    def _forget(self, seqs: list[int], groups: list[Group]) -> None:
        for seq, g in zip(seqs, groups):
            self.live_bytes -= self._sizes.pop(seq, 0)
            self._headers.pop(seq, None)
            if self._live_ids.get(g.group_id) == seq:
                del self._live_ids[g.group_id]

    def _release(self, step: int) -> None:
        p = self.pending.pop(step)
        self.live_bytes -= p.nbytes
        self._forget(p.seqs, p.groups)

    def _counters(self) -> dict[str, Any]:
        return {"version": self.version, "high_version": self.high_version,
                "committed_step": self.committed_step,
                "next_seq": self.next_seq, "put_samples": self.put_samples,
                "consumed_samples": self.consumed_samples, "rejected_puts": self.rejected_puts,
                "duplicate_puts": self.duplicate_puts, "evicted_batches": self.evicted_batches,
                "dropped": dict(self.dropped), "stale_by_origin": dict(self.stale_by_origin),
                "staleness_hist": {str(k): v for k, v in self.staleness_hist.items()},
                "admission_age_hist": {str(k): v for k, v in self.admission_age_hist.items()},
                "seen_ids": sorted(self._seen_ids)}

    def live_entries(self) -> list[list[Any]]:
        """The log a replay needs to rebuild this state exactly (what compaction writes)."""
        held: dict[int, Group] = {seq: g for seq, (_, g) in self.queued.items()}
        for p in self.pending.values():
            held.update(zip(p.seqs, p.groups))
        entries: list[list[Any]] = [["put", seq, held[seq]] for seq in sorted(held)]
        entries += [["take", p.step, p.version, p.seqs]
                    for p in sorted(self.pending.values(), key=lambda p: p.step)]
        entries.append(["state", self._counters()])  # last: absolute, overrides the above
        return entries

    def compact(self) -> None:
        assert self.journal is not None
        records: list[Any] = []
        for entry in self.live_entries():
            header = self._headers.get(entry[1]) if entry[0] == "put" else None
            # a put written before: the same bytes again (the group's kept frames), its
            # checksum known; anything else is encoded (and checksummed) now
            records.append((header, entry_parts(entry)) if header is not None
                           else encode_entry(entry))
        headers = self.journal.rewrite(records)
        # record sizes in the new file (the live-bytes estimate starts again from them)
        sizes = [record_size(h) for h in headers]
        held = sorted({*self.queued, *(s for p in self.pending.values() for s in p.seqs)})
        self._sizes = dict(zip(held, sizes))
        self._headers = dict(zip(held, headers))
        for p, n in zip(sorted(self.pending.values(), key=lambda p: p.step),
                        sizes[len(held):-1]):
            p.nbytes = n
        self.live_bytes = sum(sizes[:-1])

    def _maybe_compact(self) -> None:
        assert self.journal is not None
        if self.journal.size > max(2 * (self.live_bytes + _STATE_OVERHEAD + self._seen_bytes),
                                   self.compact_floor_bytes) \
                and time.monotonic() >= self._compact_after:
            try:
                self.compact()
            except OSError as e:  # no room for the new file: the log is as it was, still valid
                self._compact_after = time.monotonic() + 30.0
                self.log.warning("log_compaction_failed", path=str(self.journal.path),
                                 error=str(e), retry_in_s=30)

    def sync(self) -> None:
        if self.journal is not None:
            self.journal.sync()

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()

    # -- the rules ---------------------------------------------------------------------------

    @property
    def depth_groups(self) -> int:
        return len(self.queued)

    def put(self, group: Group) -> bool:
        return self.put_many([group]) == 1

    def put_many(self, groups: list[Group]) -> int:
        """Queue these groups in order, their records written with one write; returns how many
        of the first ones are in the queue now (the rest: full, to be sent again).

        A group put before counts as accepted and is not queued again: the retry of a put
        whose reply was lost (a restart in between), or a group a restarted rollouter
        generated again; held or trained, it counts once. A group that is not valid
        (`core.validate`: rows of different lengths, a version from the future, a reward that
        is not a finite number...) counts as accepted and is dropped at once, reason "invalid"
        (recorded, logged, its place given back to its rollouter): it never trains; so is one
        holding a token of a version lost in a rewind (`rewind`: the put was on its way),
        reason "lost_weights". Nothing is recorded if the write fails (QueueDiskError)."""
        entries: list[list[Any]] = []
        new_ids: set[str] = set()
        duplicates = accepted = 0
        room = self.capacity - len(self.queued)
        oldest: dict[int, int | None] = {}
        for group in groups:
            if group.group_id in self._seen_ids or group.group_id in new_ids:
                duplicates += 1
                accepted += 1
                continue
            # Versions are the rollouter's to check (it knows what its engines serve); here,
            # after a rewind, one past the next (a rollouter may put before this queue hears
            # of the version its engines serve) was lost with the weights that made it.
            why = invalid_group_reason(group)
            reason = INVALID if why is not None else (
                "lost_weights" if self.high_version > self.version
                and made_after(group, self.version + 1) else None)
            if reason is not None:
                log = self.log.error if reason == INVALID else self.log.warning
                log("group_refused", group=group.group_id, reason=reason, why=why,
                    origin=group_origin(group.group_id), version=self.version)
                entries.append(["refuse", group.group_id, len(group.trajectories), reason])
                new_ids.add(group.group_id)
                accepted += 1
                continue
            version = oldest_version(group, strict=True)  # integers (checked above)
            if room <= 0:
                break
            else:
                seq = self.next_seq + len(oldest)
                entries.append(["put", seq, group])
                oldest[seq] = version
                new_ids.add(group.group_id)
                room -= 1
            accepted += 1
        if entries:
            self._put_oldest = oldest
            try:
                self._record_many(entries)
            finally:
                self._put_oldest = {}
        self.duplicate_puts += duplicates
        self.rejected_puts += accepted < len(groups)  # one back-pressure event per refused put
        return accepted

    def set_version(self, version: int) -> None:
        if version > self.version:
            self._record(["version", version])

    def rewind(self, version: int) -> int:
        """The trainer resumed at `version`, older than this queue's (a cut run went on from
        its checkpoint): the version is `version` again, and every queued group admitted at a
        newer version or holding a token generated by one is dropped, reason "lost_weights":
        those weights no longer exist (the trainer makes new ones under the same numbers).
        Their places in the admission bound go back to their rollouter, as a stale drop's do.
        Batches handed out and not yet committed stay: the resumed trainer trains each again
        for the same step, at the same version number as the first time, on the same groups
        (their behaviour log-probs are those of the weights that generated them, so the
        off-policy correction is exact). Returns the samples dropped."""
        doomed = [seq for seq, (_, g) in self.queued.items()
                  if g.version_admitted > version or made_after(g, version)]
        if version == self.version and not doomed:
            return 0
        before = self.dropped["lost_weights"]
        if doomed:
            self.log.warning("groups_dropped_lost_weights", version=version,
                             was=self.version, groups=[self.queued[s][1].group_id
                                                       for s in doomed])
            self._record_many([["rewind", version], ["drop", "lost_weights", doomed]])
        else:
            self._record(["rewind", version])
        return self.dropped["lost_weights"] - before

    def drop_stale(self, version: int) -> int:
        """Drop every group past the bound for a consumer at `version`; returns samples dropped.
        A full scan only when the version moved past the last one (or a put arrived already
        past it): every hand-out calls this, and the queue can be long. Under the `admission`
        measure nothing is dropped here (module docstring)."""
        if version <= self._clean_at:
            return 0
        stale = [seq for seq, (oldest, _) in self.queued.items()
                 if is_stale(oldest, version, self.max_staleness)] \
            if self.measure == "oldest_token" else []
        if not stale:
            self._clean_at = version
            return 0
        before = self.dropped["stale"]
        self.log.info("groups_dropped_stale", version=version, max_staleness=self.max_staleness,
                      groups=[self.queued[seq][1].group_id for seq in stale])
        self._record(["drop", "stale", stale])
        self._clean_at = version  # only once recorded: a failed write scans again next time
        return self.dropped["stale"] - before

    def commit(self, committed_step: int) -> None:
        """Forget the hand-outs of every step <= committed_step (their checkpoint is written)."""
        if committed_step > self.committed_step:
            self._record(["commit", committed_step])

    def redeliver(self, step: int) -> Pending | None:
        """The uncommitted batch already handed out for this step, if any (counted as a
        redelivery, not as consumed again)."""
        p = self.pending.get(step) if step > 0 else None
        if p is not None:
            self.redelivered_batches += 1
        return p

    def take(self, n: int, version: int, step: int = 0) -> list[Group] | None:
        """Exactly n groups for a trainer at `version`, oldest first, or None if fewer remain
        after dropping the stale ones. step > 0: kept until committed (see `commit`)."""
        assert step not in self.pending, "redeliver() answers a step already handed out"
        version = max(version, self.version)
        self.drop_stale(version)
        if len(self.queued) < n:
            return None
        if step > 0 and step <= self.committed_step:
            self.log.warning("get_batch_for_committed_step", step=step,
                             committed_step=self.committed_step)
            step = 0  # a checkpoint already covers it: nothing to keep it for
        # The oldest first (then in put order): a group that finished late (resumed across an
        # engine restart, say) is trained before the fresher ones put before it, so it meets
        # its staleness deadline instead of being dropped at the next version; under the
        # admission measure, the earliest admitted first (no group waits behind later ones).
        if self.measure == "admission":
            keys = ((g.version_admitted, seq) for seq, (_, g) in self.queued.items())
        else:
            keys = ((oldest if oldest is not None else version, seq)
                    for seq, (oldest, _) in self.queued.items())
        seqs = [seq for _, seq in heapq.nsmallest(n, keys)]
        groups = self._record(["take", step, version, seqs])
        while len(self.pending) > self.max_pending_batches:
            oldest = min(self.pending)
            self.log.warning("uncommitted_batch_evicted", step=oldest,
                             committed_step=self.committed_step,
                             max_pending_batches=self.max_pending_batches)
            self.evicted_batches += 1
            self._record(["forget", oldest])
        return groups

    def hand_out(self, step: int, n: int, version: int) -> tuple[list[Group], int, bool] | None:
        """The batch for `step` as (groups, version, redelivered): the one handed out before for
        it if any (`redeliver`), else `take`; None if too few groups remain."""
        again = self.redeliver(step)
        if again is not None:
            return again.groups, again.version, True
        groups = self.take(n, version, step)
        if groups is None:
            return None
        return groups, max(version, self.version), False

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        while self._consumed_times and now - self._consumed_times[0][0] > 60:
            self._consumed_times.popleft()
        recent = sum(k for _, k in self._consumed_times)
        span = now - self._consumed_times[0][0] if self._consumed_times else 0.0
        out = {
            "depth_groups": len(self.queued), "depth_samples": self.depth_samples,
            "capacity_groups": self.capacity, "version": self.version,
            "put_samples": self.put_samples, "consumed_samples": self.consumed_samples,
            "dropped": dict(self.dropped), "rejected_puts": self.rejected_puts,
            "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())},
            "admission_age_hist": {str(k): v for k, v in sorted(self.admission_age_hist.items())},
            "staleness_measure": self.measure,
            "consumed_per_s": recent / span if span > 0 else 0.0,
            "max_staleness": self.max_staleness,
            "pending_batches": len(self.pending),
            "pending_samples": sum(p.samples for p in self.pending.values()),
            "committed_step": self.committed_step, "redelivered_batches": self.redelivered_batches,
            "duplicate_puts": self.duplicate_puts, "evicted_batches": self.evicted_batches,
            "durable": self.journal is not None,
        }
        if self.journal is not None:
            out.update(log_bytes=self.journal.size, log_live_bytes=self.live_bytes,
                       log_compactions=self.journal.compactions,
                       log_fsyncs=self.journal.fsyncs, replayed_records=self.replayed_records,
                       log_error=self.log_error, log_write_failures=self.log_write_failures)
        return out



def default_capacity(exp: ExperimentConfig, shards: int = 1) -> int:
    """Enough for every group the staleness bound lets exist at once, and one batch more; with
    several queue shards, each shard's part of that and one more share of a batch (the
    rollouters keep the shards even, not exactly equal)."""
    per_version = exp.rollout.batch_groups * exp.sync.sync_every
    whole = (exp.staleness.max_staleness + 2) * per_version
    if shards == 1:
        return whole
    return -(-whole // shards) + -(-exp.rollout.batch_groups // shards)

