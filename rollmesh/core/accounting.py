"""The accounting identity, the project's central promise: nothing admitted is lost.

    admitted = consumed + dropped + in flight

Owns: the typed records of the status each role reports that the accounting reads
(`RolloutStatus` from the rollouter's stats, `QueueStatus` from the MessageQueue's,
`TrainerStatus` from the trainer's), parsed from their status / `Metrics.values` dicts here and
nowhere else, with a `StatusError` naming the role and the key when one is missing or not a
count; and the identity itself (`identity`, `Identity`), with its terms, whether it holds, and
its form in `summary.json` (`Identity.summary`, `Identity.from_summary`).

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

The users: `monitor.StatusBoard` (live), `launcher.Launcher.collect_summary` (summary.json) and
its progress watchdog's snapshot, and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


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

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    @property
    def off(self) -> int:
        """put - (consumed + depth + dropped): 0 when the queue balances."""
        return self.put_samples - (self.consumed_samples + self.depth_samples
                                   + self.dropped_total)


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
