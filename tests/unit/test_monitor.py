"""`rollmesh monitor` against a real status hub: CURVE proxy, secure publishers, the CLI as a
subprocess; the board's rules (liveness, history, accounting) and the dashboard in-process."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from rollmesh.observe.monitor import MonitorError, StatusBoard, find_run_dir, load_run
from rollmesh.observe.render import render, sparkline
from rollmesh.wire.messages import Metrics
from rollmesh.wire.transport import CurveKeys, Transport
from rollmesh.wire.channels import Publisher, StatusProxy

ROOT = Path(__file__).resolve().parents[2]

PROCESSES = [
    {"name": "engine[0]", "role": "engine", "instance": 0, "host": "local", "pid": 100,
     "state": "running", "restarts": 0, "exit_code": None, "log": "logs/engine-0.log"},
    {"name": "rollouter[0]", "role": "rollouter", "instance": 0, "host": "local", "pid": 101,
     "state": "ready", "restarts": 0, "exit_code": None, "log": "logs/rollouter-0.log"},
    {"name": "agent_worker[0]", "role": "agent_worker", "instance": 0, "host": "local",
     "pid": 102, "state": "ready", "restarts": 1, "exit_code": None, "log": "logs/aw-0.log"},
    {"name": "agent_worker[1]", "role": "agent_worker", "instance": 1, "host": "gpu-2",
     "pid": 103, "state": "ready", "restarts": 0, "exit_code": None, "log": "logs/aw-1.log"},
    {"name": "reward_worker[0]", "role": "reward_worker", "instance": 0, "host": "local",
     "pid": 104, "state": "ready", "restarts": 0, "exit_code": None, "log": "logs/rw-0.log"},
    # Listed by the launcher, never publishes: the monitor must show it silent.
    {"name": "reward_worker[1]", "role": "reward_worker", "instance": 1, "host": "local",
     "pid": 105, "state": "silent", "restarts": 2, "exit_code": None, "log": "logs/rw-1.log"},
    {"name": "message_queue[0]", "role": "message_queue", "instance": 0, "host": "local",
     "pid": 106, "state": "ready", "restarts": 0, "exit_code": None, "log": "logs/mq-0.log"},
    {"name": "trainer[0]", "role": "trainer", "instance": 0, "host": "gpu-1", "pid": 107,
     "state": "ready", "restarts": 0, "exit_code": None, "log": "logs/trainer-0.log"},
    {"name": "synchronizer[0]", "role": "synchronizer", "instance": 0, "host": "local",
     "pid": 108, "state": "ready", "restarts": 0, "exit_code": None, "log": "logs/sync-0.log"},
]
ENGINES = [{"url": "http://127.0.0.1:28010", "healthy": True, "running_requests": 5,
            "waiting_requests": 2, "weight_version": 3}]
ROLLOUTER = {
    "admitted_samples": 64, "admitted_groups": 16, "accepted_groups": 10, "queued_samples": 46,
    "version": 3, "paused": False, "capacity": 2, "running_groups": 4, "in_flight": 12,
    "pending": 2, "cancel_queue": 3, "to_score": 1, "ready_groups": 0, "interrupted": 5,
    "dropped": {"filtered": 4, "reward_failed": 2},
    "workers": {"agent_worker-0": {"kind": "agent", "credits": 8, "out": 4},
                "agent_worker-1": {"kind": "agent", "credits": 8, "out": 2},
                "reward_worker-0": {"kind": "reward", "credits": 8, "out": 1}},
    "channel_protocol_errors": 0,
}
QUEUE = {
    "depth_groups": 2, "depth_samples": 8, "capacity_groups": 12, "version": 3,
    "put_samples": 46, "consumed_samples": 36, "dropped": {"stale": 2},
    "rejected_puts": 1, "staleness_hist": {"0": 20, "1": 12, "2": 4}, "consumed_per_s": 3.5,
    "max_staleness": 2,
}
# The identity holds: admitted 64 = consumed 36 + dropped (4 + 2 + 2) + in flight (12 + 8);
# each side balances too: rollouter 64 = 12 in flight + 6 dropped + 46 queued, queue put 46 =
# 36 consumed + 8 deep + 2 dropped.
SYNC = {"last_sync": {"version": 3, "ok": True, "pause_s": 0.21, "broadcast_s": 1.5,
                      "resume_s": 0.02, "total_s": 1.73, "trainer_idle_s": 1.6},
        "syncs": 3, "failures": 0}


def reward(step: int) -> float:
    return round(0.1 + 0.05 * step, 4)


def trainer_values(step: int) -> dict:
    return {"step": step, "version": 3, "loss": round(1.0 / (step + 1), 4), "pg_loss": 0.3,
            "reward_mean": reward(step), "tokens_per_s": 1234.5, "samples_consumed": 36,
            "batch_staleness_max": 1, "clip_frac": 0.02, "approx_kl": 0.001, "entropy": 1.2,
            "grad_norm": 0.8, "lr": 1e-6}


# two agent workers' clients' counters for the engine (EngineClient.cache_stats): the monitor
# sums them per engine URL, 900 of 1200 prompt tokens cached; the second worker also used an
# engine the launcher does not list (it counts in the overall rate only)
CACHE_0 = {"requests": 8, "prompt_tokens": 800, "cached_tokens": 700, "hit_rate": 0.875}
CACHE_1 = {"requests": 4, "prompt_tokens": 400, "cached_tokens": 200, "hit_rate": 0.5}


def role_values(step: int) -> list[tuple[str, int, str, dict]]:
    """(role, instance, host, the role's stats) as each role publishes them."""
    return [
        ("rollouter", 0, "local", ROLLOUTER),
        ("message_queue", 0, "local", QUEUE),
        ("agent_worker", 0, "local", {"running": 3, "finished": 40, "interrupted": 2, "failed": 1,
                                      "generated_tokens": 9000,
                                      "prefix_cache": {ENGINES[0]["url"]: CACHE_0}}),
        ("agent_worker", 1, "gpu-2", {"running": 1, "finished": 30, "interrupted": 3,
                                      "failed": 0, "generated_tokens": 7000,
                                      "prefix_cache": {ENGINES[0]["url"]: CACHE_1,
                                                       "http://10.0.0.9:1": CACHE_1}}),
        ("reward_worker", 0, "local", {"ok": 60, "error": 1, "timeout": 2}),
        ("trainer", 0, "gpu-1", trainer_values(step)),
        ("synchronizer", 0, "local", SYNC),
    ]


def metrics(role: str, instance: int, host: str, stats: dict) -> tuple[str, Metrics]:
    values = {"instance": instance, "pid": 1000 + instance, "ready": True, **stats}
    return f"metrics.{role}.{instance}", Metrics(role=role, host=host, values=values)


def launcher_metrics(elapsed_s: float = 42.0) -> Metrics:
    return Metrics(role="launcher", host="local", values={
        "run": "local-1", "state": "running", "processes": PROCESSES, "engines": ENGINES,
        "elapsed_s": elapsed_s})


def make_run(tmp_path: Path, hub_backend: str = "tcp://127.0.0.1:1") -> Path:
    run = tmp_path / "local-1"
    CurveKeys.generate(run / "keys", ["launcher", "monitor"])
    (run / "launcher.json").write_text(json.dumps({
        "name": "local-1", "run_dir": str(run), "pid": os.getpid(), "hub_frontend": "",
        "hub_backend": hub_backend, "control": "", "started_at": 0.0,
        "cluster_file": "launch/local.toml", "experiment_file": "configs/tiny_cpu.toml",
        "max_staleness": 2}))
    return run


async def monitor_against_hub(tmp_path: Path, *extra: str, timeout_s: float = 20.0):
    """Run `rollmesh monitor RUN --json --once` while secure publishers feed a real CURVE hub
    (launcher + every role, every 0.1 s; the trainer advances a step every 2nd publication)."""
    run = make_run(tmp_path)
    with Transport(CurveKeys.load(run / "keys", "launcher")) as t:
        hub = StatusProxy(t, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", secure=True)
        info = json.loads((run / "launcher.json").read_text())
        (run / "launcher.json").write_text(json.dumps({**info, "hub_frontend": hub.frontend,
                                                       "hub_backend": hub.backend}))
        launcher_pub = Publisher(t, hub.frontend, secure=True)
        role_pub = Publisher(t, hub.frontend, secure=True)
        published_steps: list[int] = []

        async def publish() -> None:
            i = 0
            while True:
                step = i // 2
                published_steps.append(step)
                await launcher_pub.publish("launcher", launcher_metrics())
                for role, instance, host, stats in role_values(step):
                    await role_pub.publish(*metrics(role, instance, host, stats))
                i += 1
                await asyncio.sleep(0.1)

        publishing = asyncio.create_task(publish())
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rollmesh", "monitor", str(run), "--json", "--once", *extra,
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        finally:
            publishing.cancel()
            await asyncio.gather(publishing, return_exceptions=True)
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            launcher_pub.close()
            role_pub.close()
            hub.close()
    return run, proc.returncode, out.decode(), err.decode()


def test_monitor_json_once_shows_every_field(tmp_path):
    run, code, out, err = asyncio.run(monitor_against_hub(tmp_path))
    assert code == 0, err
    snap = json.loads(out)
    assert snap["run"] == "local-1" and snap["state"] == "running" and snap["elapsed_s"] == 42.0
    assert snap["run_dir"] == str(run) and snap["hub"].startswith("tcp://127.0.0.1:")
    assert snap["launcher"]["alive"]

    roles = {r["name"]: r for r in snap["roles"]}
    assert list(roles) == [p["name"] for p in PROCESSES]
    for name in ("rollouter[0]", "agent_worker[0]", "agent_worker[1]", "reward_worker[0]",
                 "message_queue[0]", "trainer[0]", "synchronizer[0]"):
        r = roles[name]
        assert r["alive"] and r["liveness"] == "alive" and r["last_seen_s"] < 3, r
        assert r["pid"] == 1000 + r["instance"]  # the role's own pid wins over the launcher's
    assert roles["agent_worker[1]"]["host"] == "gpu-2" and roles["agent_worker[0]"]["restarts"] == 1
    assert roles["engine[0]"]["alive"] and roles["engine[0]"]["pid"] == 100  # the launcher's word
    silent = roles["reward_worker[1]"]
    assert not silent["alive"] and silent["liveness"] == "silent" and silent["restarts"] == 2
    assert silent["last_seen_s"] is None and silent["state"] == "silent"

    tr = snap["trainer"]
    steps = tr["history_steps"]
    # One point per step (each step was published twice), in order, with that step's values.
    assert len(steps) >= 3 and steps == list(range(steps[0], steps[0] + len(steps)))
    assert tr["reward_history"] == [reward(s) for s in steps]
    assert tr["loss_history"] == [round(1.0 / (s + 1), 4) for s in steps]
    assert tr["step"] == steps[-1] and tr["reward_mean"] == reward(steps[-1])
    assert tr["version"] == 3 and tr["tokens_per_s"] == 1234.5 and tr["batch_staleness_max"] == 1
    assert tr["lr"] == 1e-6 and tr["ranks"] == 1

    ro = snap["rollouter"]
    assert (ro["admitted"], ro["in_flight"], ro["cancel_queue"], ro["running_groups"],
            ro["paused"], ro["version"]) == (64, 12, 3, 4, False, 3)
    assert ro["agent_workers"] == 2 and ro["reward_workers"] == 1

    q = snap["queue"]
    assert q["depth"] == 8 and q["consumed"] == 36 and q["consumed_per_s"] == 3.5
    assert q["staleness_hist"] == {"0": 20, "1": 12, "2": 4}
    assert q["dropped"] == {"filtered": 4, "reward_failed": 2, "stale": 2}  # MQ + rollouter
    assert q["dropped_by"] == {"message_queue": {"stale": 2},
                               "rollouter": {"filtered": 4, "reward_failed": 2}}

    assert snap["workers"]["agent"] == {"count": 2, "running": 4, "finished": 70,
                                        "interrupted": 5, "failed": 1, "generated_tokens": 16000,
                                        "prefix_cache_hit_rate": round(1100 / 1600, 4)}
    assert snap["workers"]["reward"] == {"count": 1, "ok": 60, "error": 1, "timeout": 2}
    assert snap["engines"] == [{**ENGINES[0], "load": 7, "prefix_cache_hit_rate": 0.75}]
    assert snap["last_sync"] == {**SYNC["last_sync"], "ok": True, "syncs": 3, "failures": 0}
    assert snap["failure"] is None
    assert snap["accounting"] == {"admitted": 64, "consumed": 36, "dropped_total": 8,
                                  "in_flight": 20, "difference": 0, "holds": True,
                                  "rollouter_balances": True, "queue_balances": True,
                                  "between": 0}


def test_monitor_with_a_strangers_keys_is_refused_and_says_why(tmp_path):
    stranger = CurveKeys.generate(tmp_path / "stranger", ["monitor"])
    run, code, out, err = asyncio.run(
        monitor_against_hub(tmp_path, "--keys", str(stranger.directory)))
    assert code == 2 and out == ""
    assert "refused the CURVE handshake" in err, err
    assert str(stranger.directory) in err and str(run / "keys") in err


def test_monitor_of_a_dead_run_gives_up_with_a_clear_message(tmp_path):
    run = make_run(tmp_path)  # launcher.json names a hub nobody serves
    out = subprocess.run([sys.executable, "-m", "rollmesh", "monitor", str(run), "--json",
                          "--once", "--wait", "0.5"], cwd=ROOT, capture_output=True, text=True,
                         timeout=20)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == (f"rollmesh monitor: no status from tcp://127.0.0.1:1 after 0.5s: "
                                  f"is the run alive, and are {run / 'keys'} the run's keys?")
    missing = subprocess.run([sys.executable, "-m", "rollmesh", "monitor", str(run), "--once",
                              "--keys", str(tmp_path / "nowhere")], cwd=ROOT,
                             capture_output=True, text=True, timeout=20)
    assert missing.returncode == 2 and "cannot load CURVE keys" in missing.stderr


def test_run_found_from_a_cluster_file_is_the_newest_with_launcher_json(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    cluster = tmp_path / "cluster.toml"
    cluster.write_text((ROOT / "launch/local.toml").read_text()
                       .replace('"../configs/tiny_cpu.toml"', f'"{ROOT / "configs/tiny_cpu.toml"}"')
                       .replace('run_dir = "runs"', f'run_dir = "{runs}"'))
    for i, name in enumerate(("local-a", "local-b", "other-c")):
        make_run(runs, f"tcp://127.0.0.1:{28001 + i}").rename(runs / name)
        os.utime(runs / name / "launcher.json", (1000 + i, 1000 + i))
    (runs / "local-z").mkdir()  # newer, but no launcher.json: not a run yet
    assert find_run_dir(cluster) == runs / "local-b"
    run = load_run(find_run_dir(runs / "local-a"))
    assert run.hub == "tcp://127.0.0.1:28001" and run.keys_dir == runs / "local-a" / "keys"
    assert load_run(runs / "local-a", hub="tcp://*:9").hub == "tcp://127.0.0.1:9"
    with pytest.raises(MonitorError, match="no launcher.json"):
        load_run(runs / "local-z")
    with pytest.raises(MonitorError, match="no such run directory or cluster file"):
        find_run_dir(tmp_path / "missing")


def feed(board: StatusBoard, step: int, now: float, *, queue: dict | None = None,
         rollouter: dict | None = None) -> None:
    board.update("launcher", launcher_metrics(), now)
    for role, instance, host, stats in role_values(step):
        stats = {"message_queue": queue, "rollouter": rollouter}.get(role) or stats
        board.update(*metrics(role, instance, host, stats), now)


def accounting_line(board: StatusBoard) -> str:
    console = Console(record=True, width=200)
    console.print(render(board.snapshot(), width=200))
    return next(line for line in console.export_text().splitlines() if "admitted 64 =" in line
                or "admitted 72 =" in line)


def test_board_liveness_history_and_accounting():
    board = StatusBoard()
    assert board.snapshot(0.0)["accounting"]["holds"] is None  # nothing heard: unknown, not false
    for step in (0, 0, 1, 2, 2, 3):
        feed(board, step, now=10.0)
    snap = board.snapshot(now=12.9)
    assert snap["trainer"]["history_steps"] == [0, 1, 2, 3]
    assert snap["trainer"]["reward_history"] == [reward(s) for s in range(4)]
    assert all(r["alive"] for r in snap["roles"] if r["name"] != "reward_worker[1]")
    later = board.snapshot(now=13.1)  # 3 s without a word: silent, the launcher too
    assert not later["launcher"]["alive"]
    assert [r["liveness"] for r in later["roles"]] == ["silent"] * len(PROCESSES)
    # The queue counts a drop its put/consumed/depth do not explain: a leak on the queue's side.
    feed(board, 4, now=20.0, queue={**QUEUE, "dropped": {"stale": 2, "filtered": 1}})
    acc = board.snapshot(now=20.0)["accounting"]
    assert acc["dropped_total"] == 9 and acc["difference"] == -1 and acc["holds"] is False
    assert acc["rollouter_balances"] and not acc["queue_balances"] and acc["between"] == 0
    assert "✗ off by -1: the MessageQueue does not balance" in accounting_line(board)
    # The rollouter heard after 8 more samples went to the queue, the queue before: nothing is
    # lost, each side balances, the difference is the samples between them.
    feed(board, 5, now=21.0, rollouter={**ROLLOUTER, "admitted_samples": 72, "queued_samples": 54})
    acc = board.snapshot(now=21.0)["accounting"]
    assert (acc["difference"], acc["holds"], acc["between"]) == (8, False, 8)
    assert acc["rollouter_balances"] and acc["queue_balances"]
    assert "≈ off by 8: +8 samples between the rollouter and the queue" in accounting_line(board)


def test_dashboard_renders_every_panel():
    board = StatusBoard()
    for step in range(8):
        feed(board, step, now=5.0)
    console = Console(record=True, width=140)
    console.print(render(board.snapshot(now=5.5), width=console.width))
    text = console.export_text()
    for label in ("rollmesh monitor", "local-1", "running", "0:00:42", "Roles", "agent_worker[1]",
                  "gpu-2", "silent", "restarts", "Engines", "127.0.0.1:28010", "cache", "75%",
                  "Workers",
                  "generated tokens", "Trainer", "weight version", "reward mean", "reward history",
                  "tokens/s", "1,234", "Rollouter", "admitted", "in flight", "cancel queue",
                  "MessageQueue", "staleness", "dropped", "reward_failed", "stale", "Last sync",
                  "broadcast s", "Accounting",
                  "admitted 64 = consumed 36 + dropped 8 + in flight 20  ✓ holds"):
        assert label in text, label
    assert sparkline([reward(s) for s in range(8)]) in text
    assert "█" * 24 in text  # the tallest staleness bar
    narrow = Console(record=True, width=80)
    narrow.print(render(board.snapshot(now=5.5), width=narrow.width))
    stacked = narrow.export_text()  # one column of panels on a narrow terminal
    assert "cancel queue" in stacked and "agent_worker[1]" in stacked and "holds" in stacked


def test_last_sync_accepts_the_synchronizers_own_field_name():
    board = StatusBoard()
    board.update(*metrics("synchronizer", 0, "local", {"syncs": 0, "last": None}), 1.0)
    assert board.snapshot(1.0)["last_sync"] is None  # no sync yet
    board.update(*metrics("synchronizer", 0, "local", {
        "syncs": 2, "failures": 1, "last": {"version": 2, "ok": True, "pause_s": 0.5,
                                            "broadcast_s": 1.0, "resume_s": 0.25,
                                            "trainer_idle_s": 1.9}}), 1.0)
    assert board.snapshot(1.0)["last_sync"] == {
        "version": 2, "ok": True, "pause_s": 0.5, "broadcast_s": 1.0, "resume_s": 0.25,
        "total_s": 1.75, "trainer_idle_s": 1.9, "syncs": 2, "failures": 1}


def test_sparkline_scales_history_to_blocks():
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert sparkline([2.0, 2.0]) == "▄▄" and sparkline([]) == ""
    assert sparkline([1, None, float("nan"), 3]) == "▁█"
    assert len(sparkline(list(range(100)), width=10)) == 10


def test_each_roles_malformed_message_count_is_shown():
    board = StatusBoard()
    board.update(*metrics("message_queue", 0, "local", {"pid": 7, "ready": True,
                                                        "protocol_errors": 13}), 1.0)
    board.update(*metrics("rollouter", 0, "local", {"pid": 8, "ready": True,
                                                    "protocol_errors": 0}), 1.0)
    rows = {r["name"]: r for r in board.snapshot(now=1.5)["roles"]}
    assert rows["message_queue[0]"]["protocol_errors"] == 13
    assert rows["rollouter[0]"]["protocol_errors"] == 0
    console = Console(record=True, width=140)
    console.print(render(board.snapshot(now=1.5), width=console.width))
    line = next(l for l in console.export_text().splitlines() if "message_queue[0]" in l)
    roles_cell = line.split("│")[1].split()  # the Roles panel's part of the line
    assert roles_cell[0] == "message_queue[0]" and roles_cell[-1] == "13", line


def test_a_log_that_cannot_be_written_is_shown_with_its_path():
    """A full disk under the MessageQueue's log or the rollouter's journal: the header says
    which file and why, in every refresh, until a write succeeds again."""
    board = StatusBoard()
    board.update(*metrics("message_queue", 0, "local", {
        "pid": 7, "ready": True, "log_error": "RUN/message_queue/queue.log: No space left on "
                                             "device"}), 1.0)
    board.update(*metrics("rollouter", 0, "local", {
        "pid": 8, "ready": True, "journal_error": "RUN/rollouter/rollouter.log: File too large"}),
        1.0)
    console = Console(record=True, width=240)
    console.print(render(board.snapshot(now=1.5), width=console.width))
    text = console.export_text()
    assert "queue log: RUN/message_queue/queue.log: No space left on device" in text
    assert "rollouter journal: RUN/rollouter/rollouter.log: File too large" in text


def test_accounting_is_unknown_until_the_rollouter_reports_it():
    board = StatusBoard()
    feed(board, 0, now=1.0, rollouter={"status_error": "RuntimeError: not yet"})
    acc = board.snapshot(now=1.0)["accounting"]
    assert acc["holds"] is None and acc["admitted"] is None  # not "admitted 0 ... off by -46"
    console = Console(record=True, width=200)
    console.print(render(board.snapshot(now=1.0), width=200))
    assert "waiting for the rollouter and the MessageQueue" in console.export_text()
    feed(board, 1, now=2.0)
    assert board.snapshot(now=2.0)["accounting"]["holds"] is True
