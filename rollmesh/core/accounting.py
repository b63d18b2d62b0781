"""The accounting identity, the project's central promise: nothing admitted is lost.

    admitted = consumed + dropped + in flight

Owns: the typed records of the status each role reports that the accounting reads
(`RolloutStatus` from the rollouter's stats, `QueueStatus` from the MessageQueue's,
`TrainerStatus` from the trainer's), parsed from their status / `Metrics.values` dicts here and
nowhere else, with a `StatusError` naming the role and the key when one is missing or not a
count; and the identity itself (`identity`, `Identity`), with its terms, whether it holds, and
its form in `summary.json` (`Identity.summary`, `Identity.from_summary`); and the totals over a
role's shards (`[roles.rollouter] count = N`, `[roles.message_queue] count = M`): the typed
statuses summed (`RolloutStatus.combine`, `QueueStatus.combine`), and whole stats dicts merged
into one shaped like a single shard's (`merge_values`, by the rules in `MERGE_RULES`).

Every term counts training samples (trajectories); evaluation trajectories are outside it.
- admitted: the rollouter's `admitted_samples` (journaled: it survives a restart; like
  `queued_samples`, one of its counters, absent from its status until first counted: 0);
- consumed: the MessageQueue's `consumed_samples`, samples in batches handed out;
- dropped: the rollouter's `dropped` by reason, then the MessageQueue's (`stale`);
- in flight: the rollouter's `in_flight` plus the MessageQueue's `depth_samples`.
Each side also balances on its own (`RolloutStatus.off`, `QueueStatus.off`): the two are heard
at different moments, so a group in transit between them puts the live identity off while
nothing is lost; their own balances tell that from a leak. docs/architecture.md, "Nothing is
lost", says what keeps the identity across faults.

The users: `monitor.StatusBoard` (live), `launcher.summary.collect_accounting` (summary.json)
and `launcher.summary.snapshot` (the progress watchdog's), and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Sequence


class StatusError(ValueError):
    """A status dict lacks a key the accounting reads, or holds something else than a count
    there; the message names the role and the key."""


# -- parsing: the one place that reads these keys ---------------------------------------------


class _Fields:
    """Reads counts out of one status dict; `what` names it in errors ("rollouter status")."""

    def __init__(self, values: Any, what: str):
        if not isinstance(values, Mapping):
            raise StatusError(f"{what}: expected a dict of values, got {type(values).__name__}")
        self.values, self.what = values, what

    def count(self, key: str) -> int:
        return _count(self.values, key, self.what, key)

    def counter(self, key: str) -> int:
        """One of the rollouter's `counters` (a Counter: a key appears when first counted, so
        an absent one is 0)."""
        return _count(self.values, key, self.what, key) if key in self.values else 0

    def mapping(self, key: str) -> Mapping[Any, Any]:
        if key not in self.values:
            raise StatusError(f"{self.what}: missing {key!r}")
        d = self.values[key]
        if not isinstance(d, Mapping):
            raise StatusError(f"{self.what}: {key}: expected a dict, got {d!r}")
        return d

    def counts(self, key: str) -> dict[str, int]:
        """A dict of counts by name (the samples dropped by reason), in the role's order."""
        d = self.mapping(key)
        return {str(name): _count(d, name, self.what, f"{key}.{name}") for name in d}

    def total(self, key: str, inner: str) -> int:
        """The sum of `inner` over a dict of dicts (each worker's trajectories `out`)."""
        total = 0
        for name, d in self.mapping(key).items():
            if not isinstance(d, Mapping):
                raise StatusError(f"{self.what}: {key}.{name}: expected a dict, got {d!r}")
            total += _count(d, inner, self.what, f"{key}.{name}.{inner}")
        return total


def _count(values: Mapping[Any, Any], key: Any, what: str, where: str) -> int:
    if key not in values:
        raise StatusError(f"{what}: missing {where!r}")
    v = values[key]
    if type(v) is not int:
        raise StatusError(f"{what}: {where}: expected an int, got {v!r}")
    return v


@dataclass(frozen=True)
class RolloutStatus:
    """What the accounting reads of the rollouter's stats (`rollout.core.RolloutCore.stats`)."""

    admitted_samples: int  # data.group_size per group admitted
    queued_samples: int  # put to the MessageQueue
    queued_any: bool  # queued_samples counted yet (the watchdog: generated unknown until then)
    in_flight: int  # held right now (`RolloutCore.in_flight`)
    dropped: dict[str, int]  # by reason: filtered, reward_failed, generation_failed, ...
    pending: int  # trajectories not dispatched yet
    cancel_queue: int
    to_score: int
    ready_groups: int  # accepted, not put yet
    out: int  # trajectories out with agent and reward workers

    @classmethod
    def parse(cls, values: Any) -> RolloutStatus:
        f = _Fields(values, "rollouter status")
        return cls(admitted_samples=f.counter("admitted_samples"),
                   queued_samples=f.counter("queued_samples"),
                   queued_any="queued_samples" in f.values, in_flight=f.count("in_flight"),
                   dropped=f.counts("dropped"), pending=f.count("pending"),
                   cancel_queue=f.count("cancel_queue"), to_score=f.count("to_score"),
                   ready_groups=f.count("ready_groups"), out=f.total("workers", "out"))

    @classmethod
    def combine(cls, statuses: Sequence[RolloutStatus]) -> RolloutStatus:
        """The rollouter shards' statuses as one: every count summed, dropped summed by reason
        (in the order first named), queued_any if any shard has queued. One status: itself."""
        return _combine(cls, statuses, "rollouter")

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    @property
    def off(self) -> int:
        """admitted - (in flight + dropped + queued): 0 when the rollouter balances."""
        return self.admitted_samples - (self.in_flight + self.dropped_total
                                        + self.queued_samples)

    @property
    def settled(self) -> bool:
        """Nothing between scoring and the queue: no sample is in transit to the queue."""
        return self.to_score == 0 and self.ready_groups == 0

    @property
    def outstanding(self) -> int:
        """Admitted and not generated yet: pending, cancelled to resend, out with workers."""
        return self.pending + self.cancel_queue + self.out


@dataclass(frozen=True)
class QueueStatus:
    """What the accounting reads of the MessageQueue's stats (`MessageQueue.stats`)."""

    put_samples: int
    consumed_samples: int  # in batches handed out (a redelivery is not counted again)
    depth_samples: int  # queued, not handed out
    dropped: dict[str, int]  # by reason: stale

    @classmethod
    def parse(cls, values: Any) -> QueueStatus:
        f = _Fields(values, "message_queue status")
        return cls(put_samples=f.count("put_samples"),
                   consumed_samples=f.count("consumed_samples"),
                   depth_samples=f.count("depth_samples"), dropped=f.counts("dropped"))

    @classmethod
    def combine(cls, statuses: Sequence[QueueStatus]) -> QueueStatus:
        """The MessageQueue shards' statuses as one: every count summed, dropped summed by
        reason (in the order first named). One status: itself."""
        return _combine(cls, statuses, "message_queue")

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    @property
    def off(self) -> int:
        """put - (consumed + depth + dropped): 0 when the queue balances."""
        return self.put_samples - (self.consumed_samples + self.depth_samples
                                   + self.dropped_total)


def _combine(cls: Any, statuses: Sequence[Any], role: str) -> Any:
    if not statuses:
        raise ValueError(f"{role}: no status to combine")
    out: dict[str, Any] = {}
    for f in fields(cls):
        vals = [getattr(s, f.name) for s in statuses]
        if isinstance(vals[0], bool):  # queued_any
            out[f.name] = any(vals)
        elif isinstance(vals[0], int):
            out[f.name] = sum(vals)
        else:  # dropped, by reason
            out[f.name] = dropped_by_reason(*vals)
    return cls(**out)


@dataclass(frozen=True)
class TrainerStatus:
    """What the launcher reads of the trainer's stats (`trainer.Link._stats`)."""

    step: int
    version: int
    samples_consumed: int  # at the end of a run, the MessageQueue's consumed_samples

    @classmethod
    def parse(cls, values: Any) -> TrainerStatus:
        f = _Fields(values, "trainer status")
        return cls(step=f.count("step"), version=f.count("version"),
                   samples_consumed=f.count("samples_consumed"))


# -- the identity --------------------------------------------------------------------------------


def dropped_by_reason(*dropped: Mapping[str, int]) -> dict[str, int]:
    """The samples dropped by reason, summed across roles, in the order first named."""
    out: dict[str, int] = {}
    for d in dropped:
        for reason, n in d.items():
            out[reason] = out.get(reason, 0) + n
    return out


@dataclass(frozen=True)
class Identity:
    """admitted = consumed + dropped + in flight, with its terms."""

    admitted: int
    consumed: int
    dropped: dict[str, int]  # by reason, across the rollouter and the MessageQueue
    in_flight: int  # the rollouter's in flight plus the MessageQueue's depth

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    @property
    def accounted(self) -> int:
        """consumed + dropped + in flight: what the admitted samples became."""
        return self.consumed + self.dropped_total + self.in_flight

    @property
    def difference(self) -> int:
        """admitted - accounted: 0 when the identity holds."""
        return self.admitted - self.accounted

    @property
    def holds(self) -> bool:
        return self.difference == 0

    def summary(self) -> dict[str, Any]:
        """The terms as `summary.json` holds them."""
        return {"admitted": self.admitted, "consumed": self.consumed,
                "in_flight": self.in_flight, "dropped": dict(self.dropped)}

    @classmethod
    def from_summary(cls, summary: Any) -> Identity:
        """The identity written by `summary` (a run's summary.json, read back)."""
        f = _Fields(summary, "summary.json")
        return cls(admitted=f.count("admitted"), consumed=f.count("consumed"),
                   dropped=f.counts("dropped"), in_flight=f.count("in_flight"))


def identity(rollouter: RolloutStatus, queue: QueueStatus) -> Identity:
    """The identity across the rollouter and the MessageQueue, from their statuses."""
    return Identity(admitted=rollouter.admitted_samples, consumed=queue.consumed_samples,
                    dropped=dropped_by_reason(rollouter.dropped, queue.dropped),
                    in_flight=rollouter.in_flight + queue.depth_samples)


# -- shards: a role's stats dicts as one ---------------------------------------------------------
#
# `merge_values` joins the whole stats dicts of one role's shards (the rollouters',
# `rollout.core.RolloutCore.stats`; the MessageQueues', `mq.store.MessageQueue.stats`; each
# with its `shard` index, and, on the status hub, the `pid`, `ready`, `instance` and
# `protocol_errors` every role publishes) into one dict shaped like a single shard's. A key
# absent from a shard, or None there, is left out of its merge (a rollouter's counter appears
# when first counted); a key None or absent everywhere stays as it was. Every key either role
# reports, and its rule:
#
#   summed (counts and sizes, each shard's own; "default" below for the int ones):
#     the rollouter's counters (admitted_groups, admitted_samples, accepted_groups,
#     queued_groups, queued_samples, rejected_groups, interrupted, filtered_groups,
#     skipped_prompts, restored_groups, workers_lost, unexpected_returns, stale_groups_dropped,
#     late_holds, held_through_sync, admission_stops, eval_interrupted,
#     messages_from_unknown_peers, unexpected_messages, bad_records, queue_full_waits),
#     capacity (each shard's own bound), running_groups, in_flight, pending, cancel_queue,
#     to_score, held, ready_groups, channel_protocol_errors, eval_pending,
#     queue_stale_groups, protocol_errors; the queue's depth_groups, depth_samples,
#     capacity_groups (per shard), put_samples, consumed_samples, rejected_puts,
#     consumed_per_s (a rate: the shards' add up), pending_batches, pending_samples,
#     redelivered_batches, duplicate_puts, evicted_batches, log_bytes, log_live_bytes,
#     log_compactions, log_fsyncs, replayed_records, log_write_failures;
#   dropped: summed by reason, in the order first named (`dropped_by_reason`);
#   workers: the union of every shard's workers (a name in two shards: merged by these rules,
#     its `out` summed, so no trajectory out is lost from the accounting);
#   staleness_hist, admission_age_hist: summed per bucket, buckets in numeric order;
#   the oldest ("min"): version, committed_step (the shard furthest behind);
#   the first shard's ("first", settings alike in every shard): staleness_measure,
#     max_staleness; and the first error heard: journal_error, log_error, status_error;
#   the longest ("max"): queue_unreachable_s, admission_stopped_s, over_sampling (the shard
#     sampling most), engines (the engines a shard knows of);
#   the fewest ("min"): engines_healthy (the healthy engines of the worst-served shard);
#   admission: the first shard's that is not "open" (a stopped shard shows), else "open";
#   paused: any shard paused; durable, ready: every shard (one without a log is not durable);
#   eval: the newest round (the highest `version`; the first shard's on a tie);
#   the process's own, kept only when there is one shard ("one"): shard, instance, pid, cursor
#     (each shard reads its own place in the data: the per-shard dicts have it).
# Any other key goes by its type ("default"): bools any, ints and floats summed, strings the
# first, dicts merged key by key by these same type rules, lists concatenated.
# Merging one dict gives that dict (equal, a copy).


def _present(vals: list[Any]) -> list[Any]:
    return [v for v in vals if v is not None]


def _first(vals: list[Any]) -> Any:
    return vals[0]


def _by_type(vals: list[Any]) -> Any:
    first = vals[0]
    if all(isinstance(v, bool) for v in vals):
        return any(vals)
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
        return sum(vals)
    if all(isinstance(v, Mapping) for v in vals):
        return _merge_dicts(vals, {})
    if all(isinstance(v, list) for v in vals):
        return [x for v in vals for x in v]
    return first  # strings, and mixed types: the first shard's


def _merge_dicts(dicts: list[Mapping[Any, Any]],
                 rules: Mapping[str, Callable[..., Any]]) -> dict[Any, Any]:
    keys: dict[Any, None] = {}
    for d in dicts:
        keys.update(dict.fromkeys(d))
    out: dict[Any, Any] = {}
    for key in keys:
        rule = rules.get(key, _by_type) if isinstance(key, str) else _by_type
        if rule is _one:  # merge_values copies a single dict whole: here, several shards
            continue
        vals = _present([d[key] for d in dicts if key in d])
        out[key] = _copy(rule(vals)) if vals else None
    return out


def _one(vals: list[Any]) -> Any:
    """A marker: the key is left out of a merge of several shards."""
    return vals[0]


def _hist(vals: list[Mapping[str, Any]]) -> dict[str, Any]:
    merged = _merge_dicts(list(vals), {})

    def order(k: Any) -> tuple[int, int, str]:
        try:
            return (0, int(k), "")
        except (TypeError, ValueError):
            return (1, 0, str(k))

    return {k: merged[k] for k in sorted(merged, key=order)}


def _newest(vals: list[Any]) -> Any:
    best = vals[0]
    for v in vals[1:]:
        if (isinstance(v, Mapping) and isinstance(best, Mapping)
                and isinstance(v.get("version"), int) and isinstance(best.get("version"), int)
                and v["version"] > best["version"]):
            best = v
    return best


def _admission(vals: list[Any]) -> Any:
    return next((v for v in vals if v != "open"), vals[0])


MERGE_RULES: dict[str, Callable[[list[Any]], Any]] = {
    "dropped": lambda vals: dropped_by_reason(*vals),
    "staleness_hist": _hist, "admission_age_hist": _hist,
    "version": min, "committed_step": min, "engines_healthy": min,
    "staleness_measure": _first, "max_staleness": _first,
    "journal_error": _first, "log_error": _first, "status_error": _first,
    "queue_unreachable_s": max, "admission_stopped_s": max, "over_sampling": max,
    "engines": max,
    "admission": _admission,
    "durable": all, "ready": all,
    "eval": _newest,
    "shard": _one, "instance": _one, "pid": _one, "cursor": _one,
}
"""How `merge_values` joins a key across shards (the list above says why); any other key
goes by its type."""


def merge_values(values: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One role's shards' stats dicts (in shard order) merged into one shaped like a single
    shard's, by `MERGE_RULES`: the totals the accounting, summary.json and the monitor show.
    No dict: {}; one: a copy of it."""
    dicts = [v for v in values if isinstance(v, Mapping)]
    if len(dicts) == 1:
        return _copy(dicts[0])
    return _merge_dicts(dicts, MERGE_RULES) if dicts else {}


def _copy(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {k: _copy(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_copy(x) for x in v]
    return v
