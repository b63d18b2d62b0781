"""The accounting identity and the parsing of the statuses it reads (rollmesh.core.accounting)."""

from __future__ import annotations

import json

import pytest

from rollmesh.core.accounting import (
    Identity, QueueStatus, RolloutStatus, StatusError, TrainerStatus, dropped_by_reason, identity,
)

# As the roles report them (Rollouter.stats, MessageQueue.stats), with keys the accounting does
# not read. admitted 64 = consumed 36 + dropped (4 + 2 + 2) + in flight (12 + 8); the rollouter
# balances (64 = 12 + 6 + 46 queued), so does the queue (put 46 = 36 + 8 + 2).
ROLLOUTER = {
    "admitted_samples": 64, "admitted_groups": 16, "queued_samples": 46, "version": 3,
    "in_flight": 12, "pending": 2, "cancel_queue": 3, "to_score": 1, "ready_groups": 0,
    "dropped": {"filtered": 4, "reward_failed": 2},
    "workers": {"agent_worker-0": {"kind": "agent", "credits": 8, "out": 4},
                "reward_worker-0": {"kind": "reward", "credits": 8, "out": 1}},
    "eval": None, "cursor": {"pos": 16},
}
QUEUE = {"depth_groups": 2, "depth_samples": 8, "put_samples": 46, "consumed_samples": 36,
         "dropped": {"stale": 2}, "version": 3, "staleness_hist": {"0": 20}}


def test_the_identity_holds_with_its_terms_and_each_side_balances():
    r, q = RolloutStatus.parse(ROLLOUTER), QueueStatus.parse(QUEUE)
    assert (r.admitted_samples, r.queued_samples, r.in_flight, r.out) == (64, 46, 12, 5)
    assert r.outstanding == 2 + 3 + 5 and not r.settled
    ident = identity(r, q)
    assert ident == Identity(admitted=64, consumed=36, in_flight=20,
                             dropped={"filtered": 4, "reward_failed": 2, "stale": 2})
    assert (ident.dropped_total, ident.accounted, ident.difference) == (8, 64, 0)
    assert ident.holds and r.off == 0 and q.off == 0


def test_a_lost_sample_breaks_the_identity_and_names_the_side():
    lost = identity(RolloutStatus.parse({**ROLLOUTER, "admitted_samples": 65}),
                    QueueStatus.parse(QUEUE))
    assert (lost.difference, lost.holds) == (1, False)
    queue = QueueStatus.parse({**QUEUE, "dropped": {"stale": 2, "filtered": 1}})
    assert queue.off == -1 and identity(RolloutStatus.parse(ROLLOUTER), queue).difference == -1
    # 8 samples on their way to the queue: the live identity is off, each side balances
    ahead = RolloutStatus.parse({**ROLLOUTER, "admitted_samples": 72, "queued_samples": 54})
    assert identity(ahead, QueueStatus.parse(QUEUE)).difference == 8 and ahead.off == 0


def test_a_counter_not_counted_yet_is_zero():
    # The rollouter's counters are a Counter: before its first admission and its first put,
    # neither key is in its status.
    fresh = {k: v for k, v in ROLLOUTER.items() if k not in ("admitted_samples", "queued_samples")}
    r = RolloutStatus.parse({**fresh, "in_flight": 0, "dropped": {}})
    assert (r.admitted_samples, r.queued_samples, r.queued_any) == (0, 0, False)
    assert identity(r, QueueStatus.parse({**QUEUE, "put_samples": 0, "consumed_samples": 0,
                                          "depth_samples": 0, "dropped": {}})).holds
    assert RolloutStatus.parse(ROLLOUTER).queued_any


def test_summary_round_trips_through_json_in_the_launchers_order():
    ident = identity(RolloutStatus.parse(ROLLOUTER), QueueStatus.parse(QUEUE))
    written = json.dumps(ident.summary())
    assert list(json.loads(written)) == ["admitted", "consumed", "in_flight", "dropped"]
    assert list(json.loads(written)["dropped"]) == ["filtered", "reward_failed", "stale"]
    assert Identity.from_summary(json.loads(written)) == ident
    off = {**json.loads(written), "in_flight": 19}
    assert not Identity.from_summary(off).holds


def test_dropped_merges_by_reason_in_the_order_first_named():
    assert dropped_by_reason({"b": 1, "a": 2}, {"a": 3, "c": 4}) == {"b": 1, "a": 5, "c": 4}
    assert list(dropped_by_reason({"b": 1, "a": 2}, {"c": 4})) == ["b", "a", "c"]
    assert dropped_by_reason() == {}


def test_trainer_status():
    t = TrainerStatus.parse({"step": 4, "version": 3, "samples_consumed": 36, "last": {}})
    assert (t.step, t.version, t.samples_consumed) == (4, 3, 36)


@pytest.mark.parametrize("parse, values, error", [
    (RolloutStatus.parse, {k: v for k, v in ROLLOUTER.items() if k != "in_flight"},
     "rollouter status: missing 'in_flight'"),
    (RolloutStatus.parse, {**ROLLOUTER, "admitted_samples": "64"},
     "rollouter status: admitted_samples: expected an int, got '64'"),
    (RolloutStatus.parse, {**ROLLOUTER, "queued_samples": True},
     "rollouter status: queued_samples: expected an int, got True"),
    (RolloutStatus.parse, {**ROLLOUTER, "dropped": [4]},
     "rollouter status: dropped: expected a dict, got [4]"),
    (RolloutStatus.parse, {**ROLLOUTER, "workers": {"agent_worker-0": {"kind": "agent"}}},
     "rollouter status: missing 'workers.agent_worker-0.out'"),
    (RolloutStatus.parse, {"pid": 101, "ready": False, "status_error": "boom"},
     "rollouter status: missing 'in_flight'"),
    (QueueStatus.parse, {**QUEUE, "dropped": {"stale": 1.5}},
     "message_queue status: dropped.stale: expected an int, got 1.5"),
    (QueueStatus.parse, {k: v for k, v in QUEUE.items() if k != "put_samples"},
     "message_queue status: missing 'put_samples'"),
    (QueueStatus.parse, None, "message_queue status: expected a dict of values, got NoneType"),
    (TrainerStatus.parse, {"step": 1, "version": 1}, "trainer status: missing 'samples_consumed'"),
    (Identity.from_summary, {"max_staleness": 2, "error": "could not collect the accounting"},
     "summary.json: missing 'admitted'"),
])
def test_a_status_without_a_term_is_a_clear_error(parse, values, error):
    with pytest.raises(StatusError) as e:
        parse(values)
    assert str(e.value) == error
