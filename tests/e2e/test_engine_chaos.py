"""Engine chaos on real runs: `kill -9` of an engine at the moment of a weight sync and at many
random moments, under `rollmesh launch` (the embedded CPU default, every role a process).

A restarted engine comes back with the initial weights (version 0). With one engine and
max_staleness = 1 nothing it generates is usable until it holds the trainer's version again,
so a run that finishes after the kill proves the engine got the current weights (before this
was fixed, the trainer starved at its step forever). The trainer's log says how each kill was
met: a broadcast that failed and was retried with the group rebuilt (`sync_broadcast_failed`),
or an engine found behind and sent the weights again (`engines_behind`, `weights_republished`).
Each test prints its figures (kills, dropped samples, time from each kill to the engine holding
the current version again) for RELIABILITY.md.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.test_launcher import (
    ROOT, assert_nothing_trained_twice, check_accounting, finish, launch, metrics, status,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Small buckets make the tiny model's broadcast many round trips, so that a kill at SyncGo lands
# in the middle of it; no evaluation, so that the run is all training.
FAST = ("--set", "rollout.eval_every=0", "--set", "sync.bucket_mb=0.02")


class LogTail:
    """The JSON lines a role appends to its log, read as they come."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, ""

    def events(self) -> list[dict]:
        try:
            with open(self.path) as f:
                f.seek(self.offset)
                data = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return []
        lines = (self.partial + data).split("\n")
        self.partial = lines.pop()
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def wait(self, event: str, timeout_s: float, proc) -> dict:
        """The next `event` appended after what was read so far."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for e in self.events():
                if e.get("event") == event:
                    return e
            if proc.poll() is not None:
                raise AssertionError(f"the launcher exited with {proc.returncode} while waiting "
                                     f"for {event}:\n{proc.stdout.read()[-4000:]}")
            time.sleep(0.005)
        raise AssertionError(f"timed out waiting for {event} in {self.path}")


def log_events(run_dir: Path, name: str) -> list[dict]:
    return LogTail(run_dir / "logs" / name).events()


def process(run_dir: Path, name: str) -> dict:
    return next(p for p in status(run_dir).get("processes", []) if p["name"] == name)


def engine_version(run_dir: Path, index: int = 0) -> str | None:
    engines = status(run_dir).get("engines") or []
    return engines[index].get("weight_version") if len(engines) > index else None


def kill_engine(run_dir: Path, name: str, proc, timeout_s: float = 120) -> float:
    """kill -9 the engine `name`, wait until the launcher restarted it; returns the kill time."""
    before = process(run_dir, name)
    killed = time.monotonic()
    os.kill(before["pid"], signal.SIGKILL)
    wait_for(lambda: process(run_dir, name)["restarts"] == before["restarts"] + 1, timeout_s,
             f"{name}'s restart", proc)
    return killed


def until_current(run_dir: Path, proc, index: int = 0, timeout_s: float = 120) -> float:
    """Seconds until engine `index` serves the trainer's latest version again (or the run
    ended: then the final check says whether it caught up)."""
    started = time.monotonic()

    def current():
        if proc.poll() is not None:
            return True
        rows = metrics(run_dir)
        served = engine_version(run_dir, index)
        return rows and served not in (None, "0") and int(served) >= rows[-1]["version"]

    wait_for(current, timeout_s, f"engine {index} to hold the trainer's version")
    return time.monotonic() - started


def figures(run_dir: Path, what: str, **extra) -> dict:
    summary = check_accounting(run_dir)
    trainer = log_events(run_dir, "trainer-0.log")
    counts = {e: sum(1 for r in trainer if r.get("event") == e)
              for e in ("sync_broadcast_failed", "engines_behind", "weights_republished")}
    refused = sum(1 for r in log_events(run_dir, "synchronizer-0.log")
                  if r.get("event") == "sync_engine_behind")
    out = {"test": what, "admitted": summary["admitted"], "consumed": summary["consumed"],
           "dropped": summary["dropped"], "in_flight": summary["in_flight"],
           **counts, "sync_ok_refused": refused, **extra}
    print(f"\nFIGURES {json.dumps(out)}")
    return out


def engine_get(run_dir: Path, url: str, path: str) -> dict | None:
    """GET an engine's route with the run's engine key; None if it does not answer."""
    import urllib.request

    token = (run_dir / "keys" / "engine.token").read_text().strip()
    request = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=2) as r:
            return json.loads(r.read() or b"null")
    except (OSError, ValueError):
        return None


def engine_url(run_dir: Path, index: int) -> str:
    return wait_for(lambda: (status(run_dir).get("engines") or [{}] * (index + 1))[index]
                    .get("url"), 60, f"engine {index}'s URL")


def held_again(run_dir: Path, url: str, proc, timeout_s: float = 120) -> None:
    """Until the engine at `url` answers with the trainer's latest version (or the run ended)."""
    def current():
        if proc.poll() is not None:
            return True
        rows = metrics(run_dir)
        info = engine_get(run_dir, url, "/get_server_info")
        return (rows and info is not None
                and int(info.get("weight_version", -1)) >= rows[-1]["version"])

    wait_for(current, timeout_s, f"{url} to hold the trainer's version")


def two_engine_cluster(tmp_path: Path) -> str:
    text = (ROOT / "launch" / "local.toml").read_text()
    text = text.replace('experiment = "../configs/tiny_cpu.toml"',
                        f'experiment = "{ROOT / "configs" / "tiny_cpu.toml"}"')
    engine = '[roles.engine]\nhost = "local"\ncount = 1'
    assert engine in text
    path = tmp_path / "two_engines.toml"
    path.write_text(text.replace(engine, engine[:-1] + "2"))
    return str(path)


@pytest.mark.long
def test_an_engine_killed_at_a_sync_gets_the_current_weights_and_the_run_finishes(tmp_path):
    """Two kills of the only engine: as a sync starts (SyncGo sent, the broadcast under way),
    then just after a sync was published (the engine held the version, then restarted)."""
    run_dir, steps = tmp_path / "run", 16
    proc = launch(run_dir, "--set", f"trainer.total_steps={steps}", *FAST)
    recover = []
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 3, 300, "training under way", proc)
        syncs = LogTail(run_dir / "logs" / "synchronizer-0.log")
        syncs.events()  # from now on
        go = syncs.wait("sync_paused", 120, proc)  # SyncGo sent: the broadcast starts now
        killed = kill_engine(run_dir, "engine[0]", proc)
        until_current(run_dir, proc)
        recover.append(round(time.monotonic() - killed, 1))
        syncs.events()
        after = syncs.wait("sync_done", 120, proc)  # published: rollout resumes at it
        killed = kill_engine(run_dir, "engine[0]", proc)
        until_current(run_dir, proc)
        recover.append(round(time.monotonic() - killed, 1))
    except BaseException:
        proc.send_signal(signal.SIGINT)  # a run that cannot go on is stopped, not waited for
        raise
    finally:
        out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert_nothing_trained_twice(rows)
    trainer = log_events(run_dir, "trainer-0.log")
    handled = [e for e in trainer if e.get("event") in ("sync_broadcast_failed", "engines_behind")]
    assert handled, "the kill went unnoticed by the trainer"
    # the sync the kill hit was not published until the restarted engine held it
    done = [e for e in log_events(run_dir, "synchronizer-0.log")
            if e.get("event") == "sync_done" and e.get("version") == go["version"]]
    assert done and done[-1]["ok"], done
    # reported ok at the first try only if the engine held the version then: otherwise the
    # trainer found it behind afterwards and sent it again
    behind = [e for e in trainer if e.get("event") == "engines_behind"]
    assert not done[0]["ok"] or behind, (done, behind)
    figures(run_dir, "killed_at_sync", killed_versions=[go["version"], after["version"]],
            first_ok=[done[0]["ok"]], recover_s=recover)


# 10 kills take about 150 s here (each restart of the engine takes 5-15 s on 2 loaded cores);
# the suite runs 4 (the second mid-broadcast; test_an_engine_killed_at_a_sync_... kills one at a
# sync for certain), CHAOS_KILLS=10 runs the 10.
KILLS = int(os.environ.get("CHAOS_KILLS", 4))


@pytest.mark.long
def test_chaos_the_only_engine_killed_again_and_again_at_random_moments(tmp_path):
    """kill -9 of the only engine, KILLS times, each at a random moment once it serves again:
    every third one as a sync starts (mid-broadcast), the others 0-1.5 s after the engine is
    back. The run always finishes, every sample is accounted for, nothing is trained twice, and
    after each kill the engine holds the trainer's version again."""
    seed = int(os.environ.get("CHAOS_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    run_dir, steps = tmp_path / "run", 40
    proc = launch(run_dir, "--set", f"trainer.total_steps={steps}", *FAST,
                  "--set", f"engine.max_restarts={KILLS + 2}")
    kills: list[dict] = []
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 2, 300, "training under way", proc)
        url = engine_url(run_dir, 0)
        syncs = LogTail(run_dir / "logs" / "synchronizer-0.log")
        while len(kills) < KILLS and len(metrics(run_dir)) < steps - 2:
            syncs.events()
            at_sync = len(kills) % 3 == 1
            if at_sync:
                syncs.wait("sync_paused", 120, proc)
            else:
                time.sleep(rng.uniform(0, 1.5))
            step = len(metrics(run_dir))
            killed = kill_engine(run_dir, "engine[0]", proc)
            held_again(run_dir, url, proc)
            kills.append({"step": step, "at_sync": at_sync,
                          "recover_s": round(time.monotonic() - killed, 1)})
    except BaseException:
        proc.send_signal(signal.SIGINT)  # a run that cannot go on is stopped, not waited for
        raise
    finally:
        out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert_nothing_trained_twice(rows)
    assert len(kills) == KILLS, (seed, kills)
    figures(run_dir, "chaos", seed=seed, kills=len(kills),
            recover_s=[k["recover_s"] for k in kills], at_steps=[k["step"] for k in kills],
            seconds=round(rows[-1]["time"] - rows[0]["time"], 1))


@pytest.mark.long
def test_two_engines_one_killed_the_run_goes_on_without_a_hiccup(tmp_path):
    """Two engines, engine[1] kill -9'ed while training: the other one carries the rollout,
    nothing is lost (drops only for staleness, counted), the run finishes, and the restarted engine gets the current weights.
    The step rate before and after the kill is reported (no timing assert)."""
    run_dir, steps = tmp_path / "run", 24
    proc = launch(run_dir, "--set", f"trainer.total_steps={steps}", "--set", "engine.count=2",
                  *FAST, cluster=two_engine_cluster(tmp_path))
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 6, 300, "training under way", proc)
        url = engine_url(run_dir, 1)
        time.sleep(random.uniform(0, 1.0))
        killed_wall, at_step = time.time(), len(metrics(run_dir))
        killed = kill_engine(run_dir, "engine[1]", proc)
        held_again(run_dir, url, proc)
        recover_s = time.monotonic() - killed
    except BaseException:
        proc.send_signal(signal.SIGINT)  # a run that cannot go on is stopped, not waited for
        raise
    finally:
        out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert_nothing_trained_twice(rows)
    summary = check_accounting(run_dir)
    # Nothing lost. A trajectory cut on the dead engine goes on on the other from its tokens;
    # one delayed past the staleness bound by that is dropped as stale and counted, with its
    # whole group (runs alone drop none; runs of the whole suite dropped 16, and once 24):
    # stale drops only, at most the groups that had a sample out: rollout.max_concurrent (16)
    # samples touch at most 16 / group_size (8) + 1 = 3 groups of 8, 24 samples.
    dropped = summary["dropped"]
    assert set(dropped) <= {"stale"} and sum(dropped.values()) <= 24, dropped
    assert sum(dropped.values()) % 8 == 0, dropped  # whole groups

    def rate(rs):  # steps per second between the first and the last row of `rs`
        return round((len(rs) - 1) / max(rs[-1]["time"] - rs[0]["time"], 1e-9), 2)

    before = [r for r in rows if r["time"] <= killed_wall][-5:]
    after = [r for r in rows if killed_wall < r["time"] <= killed_wall + 10]
    figures(run_dir, "two_engines", killed_at_step=at_step, recover_s=round(recover_s, 1),
            steps_per_s_before=rate(before) if len(before) > 1 else None,
            steps_per_s_10s_after=rate(after) if len(after) > 1 else None,
            steps_in_10s_after=len(after))


@pytest.mark.long
def test_two_trainer_ranks_republish_to_an_engine_restarted_between_syncs(tmp_path):
    """Two trainer ranks (FSDP2 over gloo), a sync every 8 steps (max_staleness 7): the engine
    is killed just after a sync was published, so it comes back with the initial weights while
    the trainer is between syncs. Rank 0 sees it behind and both ranks send it the current
    version again (`Link.republish`: rank 1 gathers its shards with rank 0); no trainer rank
    restarts, and the run finishes with everything accounted for (RELIABILITY.md listed this
    as not covered)."""
    run_dir, steps = tmp_path / "run", 24
    proc = launch(run_dir, "--set", f"trainer.total_steps={steps}", "--set", "trainer.ranks=2",
                  "--set", "roles.trainer.count=2", "--set", "sync.sync_every=8",
                  "--set", "staleness.max_staleness=7", *FAST)
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 1, 300, "training under way", proc)
        syncs = LogTail(run_dir / "logs" / "synchronizer-0.log")
        syncs.events()
        done = syncs.wait("sync_done", 300, proc)  # published: the engine holds it
        # The trainer ranks wait (SIGSTOP) while the engine restarts, so that the next sync
        # (8 steps on) cannot come first and cover it: they find it behind between syncs.
        ranks = [process(run_dir, f"trainer[{r}]")["pid"] for r in (0, 1)]
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        try:
            kill_engine(run_dir, "engine[0]", proc)
            wait_for(lambda: engine_version(run_dir) == "0", 300,
                     "the restarted engine serving the initial weights", proc)
        finally:
            for pid in ranks:
                os.kill(pid, signal.SIGCONT)
        until_current(run_dir, proc, timeout_s=300)
    except BaseException:
        proc.send_signal(signal.SIGINT)
        raise
    finally:
        out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert_nothing_trained_twice(rows)
    assert [process(run_dir, f"trainer[{r}]")["restarts"] for r in (0, 1)] == [0, 0]
    trainer = log_events(run_dir, "trainer-0.log")
    republished = [e for e in trainer if e.get("event") == "weights_republished"]
    assert republished, "the restarted engine was never sent the weights between syncs"
    assert republished[0]["version"] == done["version"], (republished, done)
    # the last row's version, and the one its sync published after it (step 24 syncs)
    assert int(engine_version(run_dir)) == rows[-1]["version"] + 1
    figures(run_dir, "two_ranks_republish",
            republished_versions=[e["version"] for e in republished])
