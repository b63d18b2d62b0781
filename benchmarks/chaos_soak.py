"""Chaos soak: the embedded CPU default (`launch/local.toml`) for `--minutes` of wall time while
a seeded random `kill -9` hits one of its role processes every `--min-gap`..`--max-gap` seconds.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/chaos_soak.py --minutes 20 --seed 1 \\
        --out chaos.json

What it does:
- launches the run with `trainer.total_steps` out of reach and every restart budget raised
  (`role_max_restarts` for the rollouter, MessageQueue, synchronizer and workers,
  `trainer.max_restarts`, `engine.max_restarts`: 1000 each), checkpoints by time every
  `--checkpoint-every-s` (60 s; the default 300 s would have a killed trainer re-train minutes);
  `--set KEY=VALUE` adds overrides;
- kills any role's process (engine, rollouter, MessageQueue, synchronizer, agent and reward
  workers, trainer), its pid read from RUN/status.json as the tests do. About one kill in five
  (`--starting-share`) is followed by a second one: the restarted process of that role, killed
  within about a second of its new pid appearing (before it reported ready; its state at the
  kill and its age are recorded, and the launcher's log says whether it saw it die starting);
- samples the RSS and open descriptors of every role process and of the launcher every
  `--sample-every` s (2 s) from /proc, keyed by role name, one series per pid (a restart starts
  a new series);
- per kill: the time, the role, the pid, `starting` or not, the time until its new pid appeared
  and was ready, and `back_s`: until it was ready AND the trainer had trained a step since;
- the longest stall: the longest wall time in which no step was trained (a row appended to
  metrics.jsonl; a step trained again after a trainer restart counts, as the run progresses),
  compared to the progress watchdog's bound (`trainer.progress_timeout_s`); the longest time
  without a new highest step is reported beside it;
- after `--minutes`: no more kills; waits until every role is ready and a step came, then
  `rollmesh stop RUN` (StopRun on the launcher's control socket) and waits for the launcher.

Checks (each named in the output; the script exits 1 if any fails):
- `stopped_cleanly`: the launcher exited by itself within `--stop-timeout` s of the stop, with
  exit code 130 (rollmesh's code for a run ended by a stop request: 0 is only for a trainer
  that reached total_steps, 1 for a failure), no failure in summary.json, and no process of
  the run left alive;
- `identity`: summary.json's admitted = consumed + dropped + in flight (the in flight terms:
  the rollouter's in flight and the MessageQueue's depth; rollmesh.core.accounting.Identity);
- `zero_lost`: the identity's difference is 0, and every sample the queue handed out was
  trained (consumed = the last row's samples_consumed) or was streamed ahead to the trainer
  when the stop came (at most two batches, which the queue keeps for a resumed trainer);
- `steps_once`: metrics.jsonl holds exactly one row per step 1..N, no step twice;
- `no_group_twice`: no group id in two rows of the final metrics.jsonl;
- `all_back`: every killed role came back (a new pid, ready);
- `stall_within_bound`: the longest stall < trainer.progress_timeout_s;
- `memory_flat`: for each pid series sampled over at least `--min-life` s (120 s), RSS growth
  after warm-up < `--max-growth` (10%): the series' first third is warm-up, and the median of
  its last third is compared to the median of its second third. Growth counts only if it
  stays: the last third's median must also be above every sample of the second third. (A
  sawtooth is no leak: the MessageQueue holds the batches it handed out until a checkpoint
  covers them, up to settings.message_queue.max_pending_batches, so its RSS rises between
  checkpoints, by ~10 MiB of ~90 at 60 s checkpoints on the tiny model, and the allocator keeps
  the high-water mark.) The series are in the JSON, to tell a slope from noise. Open
  descriptors are reported the same way (not checked: keep-alive pools fill and drain).

Output: a table on stdout and, with `--out`, a JSON document with the kills, restarts, stall,
RSS table, identity and checks. Nothing here imports from tests/.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rollmesh.core.accounting import Identity  # noqa: E402

RESTART_BUDGET = 1000
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- the run's files and processes (as tests/e2e/test_launcher.py reads them) ------------------


def free_ports_base(rng: random.Random, n: int = 64) -> int:
    """The first of `n` consecutive free ports below the ephemeral range."""
    for _ in range(500):
        base = rng.randrange(20000, 32000 - n)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports in 20000-32000")


def status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (ProcessLookupError, FileNotFoundError, PermissionError):
        return False


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def age_s(pid: int) -> float | None:
    """Seconds since the process started (/proc/PID/stat's starttime against the uptime)."""
    try:
        start = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return uptime - start / CLK_TCK


class MetricsTail:
    """metrics.jsonl read as it grows; read whole again when a restarted trainer trimmed it."""

    def __init__(self, path: Path):
        self.path, self.offset, self.ino, self.partial = path, 0, None, ""
        self.rows: list[dict] = []

    def poll(self) -> list[dict]:
        """The rows appended since the last poll (after a trim: the whole file's)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return []
        if st.st_ino != self.ino or st.st_size < self.offset:
            self.ino, self.offset, self.partial, self.rows = st.st_ino, 0, "", []
        if st.st_size == self.offset:
            return []
        with open(self.path) as f:
            f.seek(self.offset)
            data = f.read()
            self.offset = f.tell()
        lines = (self.partial + data).split("\n")
        self.partial = lines.pop()
        new = []
        for line in lines:
            try:
                new.append(json.loads(line))
            except ValueError:
                continue
        self.rows.extend(new)
        return new


def read_metrics(path: Path) -> list[dict]:
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("\n")]


def log_events(path: Path) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    except FileNotFoundError:
        pass
    return out


# -- the soak -------------------------------------------------------------------------------


@dataclass
class Kill:
    t: float  # seconds since the launch
    role: str
    pid: int
    starting: bool  # its state was not ready when it was killed
    state: str  # its state in status.json at the kill
    age_s: float | None  # how old the process was
    follow_up: bool = False  # the second kill of a pair (the restarted process)
    new_pid: int | None = None
    new_pid_s: float | None = None  # kill -> a new pid in status.json
    ready_s: float | None = None  # kill -> the new pid ready
    back_s: float | None = None  # kill -> ready and a trainer step trained since
    restarts_after: int | None = None


@dataclass
class Series:
    role: str
    pid: int
    samples: list[tuple[float, float, int]] = field(default_factory=list)  # (t, rss MiB, fds)


class Soak:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        self.run_dir = Path(args.run_dir).resolve() if args.run_dir else (
            ROOT / "runs" / f"chaos-soak-{time.strftime('%Y%m%d-%H%M%S')}-s{args.seed}")
        self.kills: list[Kill] = []
        self.series: dict[tuple[str, int], Series] = {}
        self.progress: list[tuple[float, int]] = []  # (t, step) for each row trained
        self.rows_seen: set[tuple[int, float]] = set()  # (step, time): rows counted once
        self.t0 = self.wall0 = 0.0
        self.proc: subprocess.Popen | None = None
        self.pids_seen: set[int] = set()
        self.tail = MetricsTail(self.run_dir / "metrics.jsonl")
        self.snapshot: dict = {}

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- launch, stop ---------------------------------------------------------------------

    def overrides(self) -> list[str]:
        sets = [f"trainer.total_steps={self.args.total_steps}",
                f"trainer.max_restarts={RESTART_BUDGET}",
                f"engine.max_restarts={RESTART_BUDGET}",
                f"role_max_restarts={RESTART_BUDGET}",
                f"trainer.checkpoint_every_s={self.args.checkpoint_every_s:g}",
                f"ports.base={free_ports_base(random.Random())}",
                *self.args.set]
        return [a for s in sets for a in ("--set", s)]

    def launch(self) -> None:
        self.out_path = self.run_dir.parent / f"{self.run_dir.name}.launcher.out"
        self.run_dir.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "rollmesh", "launch", self.args.cluster, "--quiet",
               "--run-dir", str(self.run_dir), *self.overrides()]
        self.command = cmd
        print("chaos soak:", " ".join(cmd), flush=True)
        self.out = open(self.out_path, "w")
        self.t0, self.wall0 = time.monotonic(), time.time()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.out, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})

    def launcher_exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def stop(self) -> tuple[int | None, float | None, str]:
        """`rollmesh stop RUN`, then wait for the launcher; (its exit code, seconds, output)."""
        began = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "rollmesh", "stop", str(self.run_dir)],
                             cwd=ROOT, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        said = (out.stdout + out.stderr).strip()
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout=self.args.stop_timeout)
        except subprocess.TimeoutExpired:
            return None, None, said
        return code, time.monotonic() - began, said

    # -- watching ---------------------------------------------------------------------------

    def poll(self) -> None:
        """status.json and the new metrics rows."""
        self.snapshot = status(self.run_dir)
        for p in self.snapshot.get("processes", []):
            if p.get("pid"):
                self.pids_seen.add(p["pid"])
        for row in self.tail.poll():
            # a row read again (metrics.jsonl rewritten whole, e.g. trimmed by a restarted
            # trainer) is no new step; the row's own time says when it was trained
            key = (row["step"], row.get("time", 0.0))
            if key in self.rows_seen:
                continue
            self.rows_seen.add(key)
            at = row["time"] - self.wall0 if "time" in row else self.now()
            self.progress.append((min(at, self.now()), row["step"]))
        self.resolve_kills()

    def processes(self) -> dict[str, dict]:
        return {p["name"]: p for p in self.snapshot.get("processes", [])}

    def sample(self) -> None:
        t = self.now()
        procs = [(p["name"], p["pid"]) for p in self.processes().values()
                 if p.get("pid") and p.get("state") != "exited"]
        assert self.proc is not None
        procs.append(("launcher", self.proc.pid))
        for name, pid in procs:
            r, f = rss_mib(pid), fds(pid)
            if r is None or f is None:
                continue
            s = self.series.setdefault((name, pid), Series(name, pid))
            s.samples.append((round(t, 1), round(r, 1), f))

    def last_step_at(self) -> float | None:
        return self.progress[-1][0] if self.progress else None

    def resolve_kills(self) -> None:
        procs, t = self.processes(), self.now()
        for k in self.kills:
            if k.back_s is not None:
                continue
            p = procs.get(k.role)
            if p is None:
                continue
            pid = p.get("pid")
            if pid and pid != k.pid and alive(pid):
                if k.new_pid != pid:  # (a follow-up kill replaces it again)
                    k.new_pid, k.new_pid_s, k.ready_s = pid, round(t - k.t, 2), None
                if k.ready_s is None and p.get("state") == "ready":
                    k.ready_s = round(t - k.t, 2)
                    k.restarts_after = p.get("restarts")
            if k.ready_s is not None:
                ready_at = k.t + k.ready_s
                if any(at >= ready_at for at, _ in self.progress[-50:]):
                    k.back_s = round(t - k.t, 2)

    def wait(self, seconds: float, *, sample_at: list[float]) -> None:
        """Poll for `seconds`, sampling memory on schedule; returns early if the launcher ends."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.launcher_exited():
            self.poll()
            if time.monotonic() >= sample_at[0]:
                self.sample()
                sample_at[0] = time.monotonic() + self.args.sample_every
            time.sleep(min(0.2, max(0.0, end - time.monotonic())))

    # -- killing ----------------------------------------------------------------------------

    def kill(self, name: str, p: dict, follow_up: bool = False) -> Kill:
        pid = p["pid"]
        k = Kill(t=round(self.now(), 2), role=name, pid=pid,
                 starting=p.get("state") != "ready", state=p.get("state", "?"),
                 age_s=None if (a := age_s(pid)) is None else round(a, 2), follow_up=follow_up)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            k.state = "gone before the kill"
        self.kills.append(k)
        print(f"  t={k.t:7.1f}s kill -9 {name} pid {pid} ({k.state}, age "
              f"{k.age_s if k.age_s is not None else '?'} s){' [while starting]' if follow_up else ''}",
              flush=True)
        return k

    def kill_while_starting(self, first: Kill, sample_at: list[float]) -> None:
        """Kill `first.role`'s next process within about a second of its pid appearing."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not self.launcher_exited():
            self.poll()
            p = self.processes().get(first.role)
            pid = p.get("pid") if p else None
            if pid and pid != first.pid and alive(pid):
                # the pid shows in status.json at the role's Hello (an engine's at its spawn),
                # up to a second late: kill it within the next second, if still not ready
                self.wait(self.rng.uniform(0.0, 1.0), sample_at=sample_at)
                p = self.processes().get(first.role) or p
                if p.get("pid") != pid or not alive(pid):
                    return
                self.kill(first.role, p, follow_up=True)
                return
            self.wait(0.05, sample_at=sample_at)

    def healthy(self) -> bool:
        procs = self.processes()
        return bool(procs) and all(p.get("state") == "ready" and alive(p.get("pid"))
                                   for p in procs.values())

    def run(self) -> dict[str, Any]:
        self.launch()
        sample_at = [time.monotonic()]
        # up and training: every process ready and a first step
        deadline = time.monotonic() + self.args.start_timeout
        while not (self.snapshot.get("state") == "running" and self.healthy() and self.progress):
            if self.launcher_exited() or time.monotonic() > deadline:
                return self.finish(stop=None, note="the run did not start")
            self.wait(0.5, sample_at=sample_at)
        started = self.now()
        print(f"chaos soak: running at t={started:.1f}s; {self.args.minutes:g} min of kills, seed "
              f"{self.args.seed}", flush=True)
        end = self.t0 + self.args.minutes * 60
        while not self.launcher_exited():
            gap = self.rng.uniform(self.args.min_gap, self.args.max_gap)
            if time.monotonic() + gap >= end:
                self.wait(end - time.monotonic(), sample_at=sample_at)
                break
            self.wait(gap, sample_at=sample_at)
            if self.launcher_exited():
                break
            procs = self.processes()
            names = sorted(procs)
            name = self.rng.choice(names)
            starting = self.rng.random() < self.args.starting_share
            p = procs[name]
            if not (p.get("pid") and alive(p["pid"])):
                continue  # (being restarted now: the draw is spent)
            first = self.kill(name, p)
            if starting:
                self.kill_while_starting(first, sample_at)
        # the end: every role back and a step trained after that, then the stop
        calm = time.monotonic() + self.args.settle_timeout
        since = None
        while not self.launcher_exited() and time.monotonic() < calm:
            self.wait(0.5, sample_at=sample_at)
            if self.healthy():
                since = since or self.now()
                if any(t > since for t, _ in self.progress[-5:]):
                    break
            else:
                since = None
        if self.launcher_exited():
            return self.finish(stop=None, note="the launcher exited before the stop")
        self.stop_t = self.now()
        self.sample()
        return self.finish(stop=self.stop())

    # -- the verdict ----------------------------------------------------------------------------

    def finish(self, stop: tuple[int | None, float | None, str] | None, note: str = "") -> dict:
        if stop is None and self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        code = self.proc.poll() if self.proc else None
        self.out.close()
        self.poll()
        end_t = getattr(self, "stop_t", self.now())
        checks: dict[str, dict[str, Any]] = {}

        def check(name: str, ok: bool, detail: Any) -> None:
            checks[name] = {"ok": bool(ok), "detail": detail}

        # the stop
        summary_path = self.run_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        leftover = sorted(p for p in self.pids_seen if alive(p))
        if stop is None:
            check("stopped_cleanly", False, f"{note} (exit code {code})")
        else:
            s_code, s_took, said = stop
            ok = (s_code == 130 and not summary.get("failure") and not leftover)
            check("stopped_cleanly", ok, {
                "exit_code": s_code, "stop_to_exit_s": None if s_took is None else round(s_took, 1),
                "failure": summary.get("failure"), "left_alive": leftover,
                "rollmesh_stop": said[-300:]})

        # accounting
        identity = None
        if summary:
            try:
                ident = Identity.from_summary(summary)
                identity = {**ident.summary(), "accounted": ident.accounted,
                            "difference": ident.difference}
                check("identity", ident.holds, identity)
            except Exception as e:  # noqa: BLE001 - a summary without the counters
                check("identity", False, f"summary.json unreadable: {type(e).__name__}: {e}")
        else:
            check("identity", False, "no summary.json")
        rows = read_metrics(self.run_dir / "metrics.jsonl")
        steps = [r["step"] for r in rows]
        n = max(steps) if steps else 0
        dup = sorted({s for s in steps if steps.count(s) > 1}) if len(steps) != len(set(steps)) else []
        check("steps_once", steps == list(range(1, n + 1)),
              {"rows": len(rows), "last_step": n, "duplicates": dup[:20],
               "missing": sorted(set(range(1, n + 1)) - set(steps))[:20]})
        seen: dict[str, int] = {}
        twice = []
        for r in rows:
            for gid in r.get("group_ids", []):
                if gid in seen:
                    twice.append((gid, seen[gid], r["step"]))
                seen[gid] = r["step"]
        check("no_group_twice", not twice and bool(seen),
              {"groups": len(seen), "twice": twice[:20]})
        trained = rows[-1]["samples_consumed"] if rows else 0
        exp_toml = self.run_dir / "experiment.toml"
        exp = tomllib.loads(exp_toml.read_text()) if exp_toml.exists() else {}
        batch = (exp.get("rollout", {}).get("batch_groups", 0)
                 * exp.get("data", {}).get("group_size", 0))
        if identity is not None:
            handed = identity["consumed"]
            held = handed - trained
            # handed out and not trained: at most the batches the queue streams ahead of the
            # trainer (the next step's, sent while a step trains), which it keeps for a
            # resumed trainer until a checkpoint covers them
            ok = identity["difference"] == 0 and 0 <= held <= 2 * batch
            check("zero_lost", ok, {"difference": identity["difference"], "consumed": handed,
                                    "trained": trained, "handed_out_not_trained": held,
                                    "batch_samples": batch, "dropped": identity["dropped"]})
        else:
            check("zero_lost", False, "no identity")

        # kills
        unresolved = [asdict(k) for k in self.kills if k.ready_s is None
                      and not (k is self.kills[-1] and stop is None)]
        check("all_back", not unresolved, {"kills": len(self.kills), "not_back": unresolved})

        # stall
        times = sorted(t for t, _ in self.progress)
        gaps = [(b - a, a) for a, b in zip(times, times[1:])]
        if times:
            gaps.append((end_t - times[-1], times[-1]))
        stall, stall_at = max(gaps) if gaps else (0.0, 0.0)
        best, new_high = 0, []
        for t, s in sorted(self.progress):
            if s > best:
                best = s
                new_high.append(t)
        high_gaps = [b - a for a, b in zip(new_high, new_high[1:])]
        bound = exp.get("trainer", {}).get("progress_timeout_s", 600.0)
        stall_info = {"longest_s": round(stall, 1), "at_s": round(stall_at, 1),
                      "watchdog_bound_s": bound,
                      "longest_without_a_new_highest_step_s": round(max(high_gaps, default=0), 1)}
        check("stall_within_bound", stall < bound, stall_info)

        # memory
        rss_table = []
        bad = []
        for (name, pid), s in sorted(self.series.items(), key=lambda kv: (kv[0][0], kv[1].samples[0][0])):
            life = s.samples[-1][0] - s.samples[0][0] if s.samples else 0
            row: dict[str, Any] = {"process": name, "pid": pid, "from_s": s.samples[0][0],
                                   "to_s": s.samples[-1][0], "samples": len(s.samples),
                                   "rss_first_mib": s.samples[0][1],
                                   "rss_peak_mib": max(x[1] for x in s.samples)}
            if life >= self.args.min_life and len(s.samples) >= 9:
                third = len(s.samples) // 3
                mid = statistics.median(x[1] for x in s.samples[third:2 * third])
                late = statistics.median(x[1] for x in s.samples[-third:])
                mid_max = max(x[1] for x in s.samples[third:2 * third])
                fmid = statistics.median(x[2] for x in s.samples[third:2 * third])
                flate = statistics.median(x[2] for x in s.samples[-third:])
                growth = (late - mid) / mid if mid else 0.0
                row.update(rss_mid_mib=round(mid, 1), rss_mid_max_mib=round(mid_max, 1),
                           rss_late_mib=round(late, 1),
                           growth_pct=round(100 * growth, 1), fds_mid=fmid, fds_late=flate,
                           judged=True)
                if growth >= self.args.max_growth and late > mid_max:
                    bad.append(f"{name} pid {pid}: {mid:.1f} -> {late:.1f} MiB "
                               f"(+{100 * growth:.1f}%)")
            else:
                row["judged"] = False
            rss_table.append(row)
        judged = [r for r in rss_table if r["judged"]]
        check("memory_flat", not bad and bool(judged),
              {"rule": f"median RSS of the last third vs the second third of each pid's samples "
                       f"(first third: warm-up), for pids sampled over >= {self.args.min_life:g} s:"
                       f" it grew if that is >= {100 * self.args.max_growth:g}% and the last "
                       f"third's median is above the second third's maximum",
               "judged": len(judged), "grew": bad})

        # the launcher's own view of the restarts
        events = log_events(self.run_dir / "logs" / "launcher.log")
        kinds = ("role_restart", "trainer_restart", "trainer_restarted", "engine_restart",
                 "killed_while_starting", "trainer_restart_failed", "engine_restart_failed")
        launcher_events = {k: sum(1 for e in events if e.get("event") == k) for k in kinds}
        restarts = {p["name"]: p.get("restarts") for p in status(self.run_dir).get("processes", [])}
        backs = [k.back_s for k in self.kills if k.back_s is not None]
        result = {
            "seed": self.args.seed, "minutes": self.args.minutes, "run_dir": str(self.run_dir),
            "command": getattr(self, "command", []), "launcher_exit_code": code,
            "launcher_output": str(self.out_path),
            "ok": all(c["ok"] for c in checks.values()),
            "failed": [k for k, c in checks.items() if not c["ok"]],
            "checks": checks, "kills": [asdict(k) for k in self.kills],
            "kills_while_starting": sum(1 for k in self.kills if k.starting),
            "restarts": restarts, "launcher_events": launcher_events,
            "back_s": {"median": round(statistics.median(backs), 1) if backs else None,
                       "max": max(backs, default=None)},
            "stall": stall_info, "rss": rss_table, "identity": identity,
            "series": {f"{name} {pid}": s.samples for (name, pid), s in self.series.items()},
            "steps": {"last": n, "rows": len(rows), "trained_samples": trained},
        }
        return result


def print_table(r: dict) -> None:
    print(f"\nchaos soak, seed {r['seed']}, {r['minutes']:g} min: run {r['run_dir']}")
    print(f"\nkills ({len(r['kills'])}, {r['kills_while_starting']} while starting):")
    print(f"  {'t (s)':>7}  {'role':<18} {'pid':>7}  {'state':<8} {'age s':>6}  "
          f"{'new pid s':>9} {'ready s':>8} {'back s':>7}")
    for k in r["kills"]:
        def f(v: Any) -> str:
            return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)
        print(f"  {k['t']:7.1f}  {k['role']:<18} {k['pid']:>7}  "
              f"{('START' if k['starting'] else k['state']):<8} {f(k['age_s']):>6}  "
              f"{f(k['new_pid_s']):>9} {f(k['ready_s']):>8} {f(k['back_s']):>7}")
    print(f"\nrestarts (status.json): {r['restarts']}")
    print(f"launcher log: {r['launcher_events']}")
    print(f"back (kill -> ready and a step trained): median {r['back_s']['median']} s, "
          f"max {r['back_s']['max']} s")
    s = r["stall"]
    print(f"longest stall: {s['longest_s']} s at t={s['at_s']} s (watchdog bound "
          f"{s['watchdog_bound_s']:g} s); without a new highest step: "
          f"{s['longest_without_a_new_highest_step_s']} s")
    print(f"steps: {r['steps']}")
    print(f"identity: {r['identity']}")
    print("\nRSS per process (MiB; growth: median of the last third vs the second third):")
    print(f"  {'process':<18} {'pid':>7} {'from s':>7} {'to s':>7} {'n':>4} {'first':>7} "
          f"{'mid':>7} {'late':>7} {'growth':>7} {'peak':>7} {'fds':>9}")
    for row in r["rss"]:
        judged = row["judged"]
        print(f"  {row['process']:<18} {row['pid']:>7} {row['from_s']:>7.0f} {row['to_s']:>7.0f} "
              f"{row['samples']:>4} {row['rss_first_mib']:>7.1f} "
              f"{row['rss_mid_mib'] if judged else '-':>7} "
              f"{row['rss_late_mib'] if judged else '-':>7} "
              f"{(str(row['growth_pct']) + '%') if judged else '(short)':>7} "
              f"{row['rss_peak_mib']:>7.1f} "
              f"{(str(row['fds_mid']) + '->' + str(row['fds_late'])) if judged else '-':>9}")
    print("\nchecks:")
    for name, c in r["checks"].items():
        print(f"  {'PASS' if c['ok'] else 'FAIL'}  {name}: {json.dumps(c['detail'])[:400]}")
    print(f"\n{'OK' if r['ok'] else 'FAILED: ' + ', '.join(r['failed'])}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0, help="wall time of kills (20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-gap", type=float, default=20.0, help="seconds between kills, least")
    ap.add_argument("--max-gap", type=float, default=60.0, help="seconds between kills, most")
    ap.add_argument("--starting-share", type=float, default=0.2,
                    help="share of the kills followed by a kill of the restarted process "
                         "while it starts (0.2)")
    ap.add_argument("--sample-every", type=float, default=2.0, help="RSS/fd sampling period")
    ap.add_argument("--min-life", type=float, default=120.0,
                    help="seconds a pid must be sampled over for its RSS growth to be judged")
    ap.add_argument("--max-growth", type=float, default=0.10, help="RSS growth allowed (0.10)")
    ap.add_argument("--checkpoint-every-s", type=float, default=60.0,
                    help="trainer.checkpoint_every_s for the run (60)")
    ap.add_argument("--total-steps", type=int, default=1_000_000,
                    help="trainer.total_steps: out of reach, the stop ends the run")
    ap.add_argument("--cluster", default="launch/local.toml")
    ap.add_argument("--run-dir", default=None, help="(default runs/chaos-soak-<time>-s<seed>)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="more overrides for rollmesh launch")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--settle-timeout", type=float, default=180.0,
                    help="after the kills: seconds to wait for every role ready and a step")
    ap.add_argument("--stop-timeout", type=float, default=300.0,
                    help="seconds the launcher may take to exit after `rollmesh stop`")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    if not 0 < args.min_gap <= args.max_gap:
        ap.error("need 0 < --min-gap <= --max-gap")
    soak = Soak(args)
    try:
        result = soak.run()
    finally:
        if soak.proc is not None and soak.proc.poll() is None:  # interrupted: stop the run
            soak.proc.send_signal(signal.SIGINT)
            try:
                soak.proc.wait(120)
            except subprocess.TimeoutExpired:
                soak.proc.kill()
    print_table(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
