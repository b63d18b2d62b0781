"""The rollouter's journal: what a restarted rollouter rebuilds from it, torn tails, compaction."""

from __future__ import annotations

import structlog

from rollmesh.rollout.data import PromptGroup, PromptRow
from rollmesh.rollout.journal import Journal

LOG = structlog.get_logger("test")


def group(gid: str, row: int, n: int = 4) -> PromptGroup:
    return PromptGroup(gid, PromptRow(index=row, prompt=f"p{row}"), n, 0)


def cursor(i: int) -> dict:
    return {"cursor": {"pos": i}, "serial": i}


def scenario(j: Journal) -> None:
    j.admitted(group("g0", 0), cursor(1), 0)
    j.admitted(group("g1", 1), cursor(2), 0)
    j.admitted(group("g2", 2), cursor(3), 0)
    j.admitted(group("g3", 3), cursor(4), 1)
    j.queued("g0", 4)
    j.new_version(1)
    j.drop("g1", "reward_failed", 3, whole=True)  # one sample of g1 is still out
    j.drop("g2", "filtered", 4, whole=True)


def test_replay_rebuilds_cursor_counters_and_the_groups_in_flight(tmp_path):
    j = Journal(tmp_path / "r.log", LOG)
    scenario(j)
    j.close()
    r = Journal(tmp_path / "r.log", LOG)
    assert r.replayed == 8
    assert r.cursor == cursor(4) and r.version == 1
    assert r.counters["admitted_samples"] == 16 and r.counters["queued_samples"] == 4
    assert r.counters["rejected_groups"] == 2
    assert dict(r.dropped) == {"reward_failed": 3, "filtered": 4}
    reopen, lost = r.recover()
    # g3 was in flight: generated again; g1's straggler died with the process: dropped now
    assert [(gid, g.row, g.size, g.version) for gid, g in reopen] == [("g3", 3, 4, 1)]
    assert lost == 1 and r.dropped["group_failed"] == 1
    # the identity: admitted = queued + dropped + in flight (g3 again)
    assert r.counters["admitted_samples"] == (r.counters["queued_samples"]
                                              + sum(r.dropped.values()) + 4)


def test_a_torn_last_record_is_cut_off_and_appending_goes_on(tmp_path):
    j = Journal(tmp_path / "r.log", LOG)
    scenario(j)
    j.close()
    path = tmp_path / "r.log"
    data = path.read_bytes()
    path.write_bytes(data[:-5])  # kill -9 in the middle of the last write
    r = Journal(path, LOG)
    assert r.replayed == 7 and "g2" in r.groups and not r.groups["g2"].done
    r.queued("g3", 4)
    r.close()
    again = Journal(path, LOG)
    assert again.replayed == 8 and "g3" not in again.groups


def test_compaction_keeps_the_state_and_bounds_the_file(tmp_path):
    j = Journal(tmp_path / "r.log", LOG, compact_bytes=4096)
    for i in range(2000):  # 2,000 groups admitted and queued: far more than 4 KiB of records
        j.admitted(group(f"g{i}", i % 50), cursor(i + 1), i // 100)
        if i % 10 == 0:
            j.drop(f"g{i}", "filtered", 4, whole=True)
        elif i < 1995:
            j.queued(f"g{i}", 4)
        j.new_version(i // 100)
    assert j.file.compactions > 10
    assert (tmp_path / "r.log").stat().st_size < 4096 + 1024
    expected = (dict(j.counters), dict(j.dropped), j.cursor, j.version, sorted(j.groups))
    j.close()
    r = Journal(tmp_path / "r.log", LOG)
    assert (dict(r.counters), dict(r.dropped), r.cursor, r.version, sorted(r.groups)) == expected
    assert sorted(r.groups) == [f"g{i}" for i in range(1995, 2000)]


def test_a_pause_without_its_resume_is_remembered_through_replay_and_compaction(tmp_path):
    j = Journal(tmp_path / "r.log", LOG)
    scenario(j)
    j.pause()
    j.close()
    r = Journal(tmp_path / "r.log", LOG)
    assert r.paused and r.version == 1
    r.new_version(1)  # a failed sync resumes at the version it had: still a Resume
    r.close()
    r = Journal(tmp_path / "r.log", LOG)
    assert not r.paused and r.version == 1
    r.pause()
    r.compact()
    r.close()
    r = Journal(tmp_path / "r.log", LOG)
    assert r.replayed == 1 and r.paused
    r.new_version(2)
    assert not r.paused and r.version == 2
