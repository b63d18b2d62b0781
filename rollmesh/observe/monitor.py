"""`rollmesh monitor CLUSTER_TOML_OR_RUN_DIR`: watch a running run, read-only.

Owns: finding the run (a run directory, or the newest run of a cluster file), the one SUB
socket on the launcher's status hub (CURVE with the run's keys; a refused handshake ends the
monitor with a clear error instead of a silent wait), the latest status of every role with the
time it was heard, the trainer's reward and loss history, `snapshot()` (plain data: everything
the dashboard shows; the accounting identity comes from `rollmesh.core.accounting`) and the
dashboard drawn from it with rich.

The monitor never sends to the run: it subscribes, and detaches by closing its socket.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import zmq
from rich.console import Console
from rich.live import Live
from zmq.utils.monitor import parse_monitor_message

from rollmesh.core.accounting import (
    QueueStatus, RolloutStatus, StatusError, identity, merge_values,
)
from rollmesh.wire.messages import Metrics
from rollmesh.wire.transport import CurveKeys, Transport, TransportError
from rollmesh.observe.render import render
from rollmesh.wire.channels import Subscriber

SILENT_AFTER_S = 3.0  # a role not heard from for this long is shown silent (3 status intervals)
SETTLE_S = 1.2  # --once: after the launcher's status, listen one more status interval
REFRESH_S = 0.5
HISTORY = 120  # trainer steps kept for the sparkline
TOPICS = ("launcher", "metrics.")
NO_STATUS_ROLES = {"engine"}  # HTTP servers: their liveness is the launcher's word
TRAINER_KEYS = ("step", "version", "loss", "pg_loss", "reward_mean", "tokens_per_s",
                "samples_consumed", "batch_staleness_max", "batch_admission_age_max",
                "clip_frac", "approx_kl", "entropy", "grad_norm", "lr", "eval_reward_mean",
                "eval_version", "phase")
SYNC_KEYS = ("version", "pause_s", "broadcast_s", "resume_s", "total_s", "trainer_idle_s")
_HANDSHAKE_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no detail",
                     zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol error",
                     zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication refused"}


class MonitorError(RuntimeError):
    """The monitor cannot show this run; the message says why and what to check."""


# -- finding the run -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    name: str
    run_dir: Path
    hub: str  # the hub's XPUB, where subscribers connect
    keys_dir: Path
    launcher_pid: int | None


def find_run_dir(target: str | os.PathLike[str]) -> Path:
    """A run directory as given, or the newest `<run_dir>/<name>-*` of a cluster file that has
    a launcher.json."""
    path = Path(target)
    if path.is_dir():
        return path
    if not path.is_file():
        raise MonitorError(f"{path}: no such run directory or cluster file")
    from rollmesh.config import ConfigError, load_cluster

    try:
        cluster = load_cluster(path)
    except ConfigError as e:
        raise MonitorError(str(e)) from None
    root = Path(cluster.run_dir)
    runs = [d for d in root.glob(f"{cluster.name}-*") if (d / "launcher.json").is_file()]
    if not runs:
        raise MonitorError(f"no run of {cluster.name!r} in {root.resolve()} (no "
                           f"{cluster.name}-*/launcher.json): has `rollmesh launch {path}` "
                           "started?")
    return max(runs, key=lambda d: ((d / "launcher.json").stat().st_mtime, d.name))


def _connectable(address: str) -> str:
    """A wildcard bind address names no host to connect to: the monitor runs beside the hub."""
    for wildcard, local in (("tcp://*:", "tcp://127.0.0.1:"), ("tcp://[::]:", "tcp://[::1]:"),
                            ("tcp://0.0.0.0:", "tcp://127.0.0.1:")):
        if address.startswith(wildcard):
            return local + address[len(wildcard):]
    return address


def load_run(run_dir: Path, *, keys: str | None = None, hub: str | None = None) -> Run:
    path = run_dir / "launcher.json"
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise MonitorError(f"{run_dir}: no launcher.json (not a run directory, or the launcher "
                           "has not started yet)") from None
    except (OSError, ValueError) as e:
        raise MonitorError(f"{path}: unreadable: {e}") from None
    if not isinstance(info, dict) or not isinstance(hub or info.get("hub_backend"), str):
        raise MonitorError(f"{path}: hub_backend: expected the hub's address, e.g. "
                           "\"tcp://127.0.0.1:28001\"")
    pid = info.get("pid")
    return Run(name=str(info.get("name") or run_dir.name), run_dir=run_dir,
               hub=_connectable(hub or info["hub_backend"]),
               keys_dir=Path(keys) if keys else run_dir / "keys",
               launcher_pid=pid if type(pid) is int else None)


# -- the board: latest status per role, history, snapshot ----------------------------------------


def _num(v: Any) -> float | int | None:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _hit_rate(cached: float, prompt: float) -> float | None:
    """Prompt tokens found in a prefix cache over prompt tokens sent; None before any."""
    return round(cached / prompt, 4) if prompt else None


def _counts(v: Any) -> dict[str, int]:
    return {str(k): n for k, n in _dict(v).items() if _num(n) is not None}


def _merge(*counts: dict[str, int]) -> dict[str, int]:
    out: collections.Counter[str] = collections.Counter()
    for c in counts:
        out.update(c)
    return dict(sorted(out.items()))


def _staleness_order(item: tuple[str, int]) -> tuple[int, int, str]:
    k = _instance(item[0])
    return (0, k, "") if isinstance(k, int) else (1, 0, item[0])  # "10" after "9"


def _instance(text: Any) -> int | str:
    try:
        return int(text)
    except (TypeError, ValueError):
        return str(text)


class StatusBoard:
    """What the hub told us, with when (monotonic time of receipt, so no clock skew between
    hosts): the launcher's latest status, each role instance's latest Metrics, trainer history."""

    def __init__(self, run: Run | None = None, silent_after_s: float = SILENT_AFTER_S,
                 history: int = HISTORY):
        self.run = run
        self.silent_after_s = silent_after_s
        self.launcher: tuple[dict[str, Any], float] | None = None
        self.launcher_first_seen: float | None = None
        self.roles: dict[tuple[str, int | str], tuple[Metrics, float]] = {}
        self.history: collections.deque[tuple[Any, Any, Any]] = collections.deque(maxlen=history)
        self.received = 0

    def update(self, topic: str, rec: Metrics, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.received += 1
        values = _dict(rec.values)
        if topic == "launcher" or rec.role == "launcher":
            self.launcher = (values, now)
            if self.launcher_first_seen is None:
                self.launcher_first_seen = now
            return
        parts = topic.split(".")
        role = parts[1] if len(parts) > 2 else rec.role
        key = (role, _instance(parts[2] if len(parts) > 2 else values.get("instance", 0)))
        self.roles[key] = (rec, now)
        if role == "trainer" and key[1] == 0 and values.get("step") is not None:
            # Roles republish every second: one point per trainer step, not per publication.
            if not self.history or self.history[-1][0] != values["step"]:
                self.history.append((values["step"], _num(values.get("reward_mean")),
                                     _num(values.get("loss"))))

    # -- snapshot -------------------------------------------------------------------------------

    def _values(self, role: str) -> dict[str, Any] | None:
        """The latest status of a role's lowest instance (the trainer's rank 0, the singletons)."""
        found = sorted((k for k in self.roles if k[0] == role), key=lambda k: str(k[1]))
        return _dict(self.roles[found[0]][0].values) if found else None

    def _all(self, role: str) -> list[dict[str, Any]]:
        return [_dict(rec.values) for (r, _), (rec, _) in self.roles.items() if r == role]

    def _instances(self, role: str) -> list[tuple[int | str, dict[str, Any]]]:
        """Each instance heard of a role, once (its latest status), in instance order."""
        found = sorted((k for k in self.roles if k[0] == role),
                       key=lambda k: _staleness_order((str(k[1]), 0)))
        return [(k[1], _dict(self.roles[k][0].values)) for k in found]

    def _total(self, role: str) -> dict[str, Any] | None:
        """A sharded role's status as one: the totals over every instance heard
        (`merge_values`); with one instance, its status."""
        instances = self._instances(role)
        return merge_values([v for _, v in instances]) if instances else None

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        launcher, launcher_seen = self.launcher or ({}, None)
        launcher_age = None if launcher_seen is None else now - launcher_seen
        rollouters, queues = self._instances("rollouter"), self._instances("message_queue")
        rollouter, queue = self._total("rollouter"), self._total("message_queue")
        cache = self._prefix_cache()
        snap = {
            "run": launcher.get("run") or (self.run.name if self.run else None),
            "run_dir": str(self.run.run_dir) if self.run else None,
            "hub": self.run.hub if self.run else None,
            "state": launcher.get("state"),
            "failure": launcher.get("failure"),
            "elapsed_s": _num(launcher.get("elapsed_s")),
            "launcher": {"alive": launcher_age is not None and launcher_age <= self.silent_after_s,
                         "last_seen_s": launcher_age},
            "roles": self._roles(launcher, launcher_age, now),
            "trainer": self._trainer(),
            "rollouter": self._rollouter(rollouter),
            "queue": self._queue(queue, rollouter),
            "workers": self._workers(),
            "engines": [self._engine(e, cache) for e in launcher.get("engines") or []
                        if isinstance(e, dict)],
            "last_sync": self._last_sync(),
            "accounting": self._accounting([v for _, v in rollouters], [v for _, v in queues]),
            "eval": self._eval(rollouter),
        }
        if len(rollouters) > 1 or len(queues) > 1:
            snap["shards"] = self._shards(rollouters, queues)
        return snap

    def _roles(self, launcher: dict[str, Any], launcher_age: float | None,
               now: float) -> list[dict[str, Any]]:
        rows: dict[tuple[str, int | str], dict[str, Any]] = {}
        for p in launcher.get("processes") or []:
            if not isinstance(p, dict):
                continue
            key = (str(p.get("role")), _instance(p.get("instance", 0)))
            rows[key] = {"name": p.get("name") or f"{key[0]}[{key[1]}]", "role": key[0],
                         "instance": key[1], "host": p.get("host"), "pid": p.get("pid"),
                         "state": p.get("state"), "restarts": p.get("restarts", 0),
                         "exit_code": p.get("exit_code"), "log": p.get("log")}
        for key in sorted(self.roles.keys() - rows.keys(), key=lambda k: (k[0], str(k[1]))):
            rows[key] = {"name": f"{key[0]}[{key[1]}]", "role": key[0], "instance": key[1],
                         "host": None, "pid": None, "state": None, "restarts": 0,
                         "exit_code": None, "log": None}
        launcher_alive = launcher_age is not None and launcher_age <= self.silent_after_s
        out = []
        for key, row in rows.items():
            heard = self.roles.get(key)
            if heard is not None:
                rec, seen = heard
                values = _dict(rec.values)
                row["host"] = row["host"] or rec.host
                row["pid"] = values.get("pid", row["pid"])  # its own pid: the launcher's may be ssh
                row["ready"] = values.get("ready")
                row["protocol_errors"] = values.get("protocol_errors")
                row["last_seen_s"] = now - seen
                alive = now - seen <= self.silent_after_s
            else:
                row["ready"], row["last_seen_s"] = None, None
                row["protocol_errors"] = None
                alive = (key[0] in NO_STATUS_ROLES and launcher_alive
                         and row["state"] in ("running", "ready"))
            row["alive"] = alive
            row["liveness"] = "alive" if alive else "silent"
            out.append(row)
        return out

    def _trainer(self) -> dict[str, Any]:
        values = self._values("trainer") or {}
        out: dict[str, Any] = {k: values.get(k) for k in TRAINER_KEYS}
        out["ranks"] = len(self._all("trainer"))
        out["history_steps"] = [s for s, _, _ in self.history]
        out["reward_history"] = [r for _, r, _ in self.history]
        out["loss_history"] = [l for _, _, l in self.history]
        return out

    @staticmethod
    def _rollouter(r: dict[str, Any] | None) -> dict[str, Any] | None:
        if r is None:
            return None
        workers = [w for w in _dict(r.get("workers")).values() if isinstance(w, dict)]
        return {
            "admitted": r.get("admitted_samples", 0),
            "admitted_groups": r.get("admitted_groups", 0),
            "accepted_groups": r.get("accepted_groups", 0),
            "queued_samples": r.get("queued_samples", 0), "in_flight": r.get("in_flight"),
            "cancel_queue": r.get("cancel_queue"), "running_groups": r.get("running_groups"),
            "pending": r.get("pending"), "to_score": r.get("to_score"),
            "ready_groups": r.get("ready_groups"), "paused": r.get("paused"),
            "version": r.get("version"), "capacity": r.get("capacity"),
            "interrupted": r.get("interrupted", 0), "workers_lost": r.get("workers_lost", 0),
            "agent_workers": sum(w.get("kind") == "agent" for w in workers),
            "reward_workers": sum(w.get("kind") == "reward" for w in workers),
            "dropped": _counts(r.get("dropped")),
            "engines_healthy": r.get("engines_healthy"), "engines": r.get("engines"),
            "admission": r.get("admission"),
            "admission_stopped_s": r.get("admission_stopped_s"),
            "journal_error": r.get("journal_error"),
            "queue_unreachable_s": r.get("queue_unreachable_s"),
        }

    @staticmethod
    def _queue(q: dict[str, Any] | None, r: dict[str, Any] | None) -> dict[str, Any] | None:
        if q is None and r is None:
            return None
        q = q or {}
        hist = dict(sorted(_counts(q.get("staleness_hist")).items(), key=_staleness_order))
        ages = dict(sorted(_counts(q.get("admission_age_hist")).items(), key=_staleness_order))
        mq_dropped, r_dropped = _counts(q.get("dropped")), _counts((r or {}).get("dropped"))
        return {
            "depth": q.get("depth_samples"), "depth_groups": q.get("depth_groups"),
            "log_error": q.get("log_error"),
            "capacity_groups": q.get("capacity_groups"), "version": q.get("version"),
            "put": q.get("put_samples"), "consumed": q.get("consumed_samples"),
            "consumed_per_s": q.get("consumed_per_s"), "rejected_puts": q.get("rejected_puts"),
            "max_staleness": q.get("max_staleness"), "staleness_hist": hist,
            "admission_age_hist": ages, "staleness_measure": q.get("staleness_measure"),
            "dropped": _merge(mq_dropped, r_dropped),
            "dropped_by": {"message_queue": mq_dropped, "rollouter": r_dropped},
        }

    def _workers(self) -> dict[str, dict[str, int]]:
        def total(role: str, keys: tuple[str, ...]) -> dict[str, int]:
            return {k: sum(_num(v.get(k)) or 0 for v in self._all(role)) for k in keys}

        agent = total("agent_worker", ("running", "finished", "interrupted", "failed",
                                       "generated_tokens"))
        reward = total("reward_worker", ("ok", "error", "timeout"))
        cache = self._prefix_cache().values()
        agent["prefix_cache_hit_rate"] = _hit_rate(sum(c["cached_tokens"] for c in cache),
                                                   sum(c["prompt_tokens"] for c in cache))
        return {"agent": {"count": len(self._all("agent_worker")), **agent},
                "reward": {"count": len(self._all("reward_worker")), **reward}}

    def _prefix_cache(self) -> dict[str, dict[str, int]]:
        """Per engine URL, the agent workers' prefix-cache counters (their clients' `cache_stats`:
        requests, prompt tokens, of which the engine found cached) summed over the workers.
        Summed here rather than in the rollouter: the workers publish their status to the hub,
        which the monitor reads; the rollouter does not hear it."""
        out: dict[str, dict[str, int]] = {}
        for values in self._all("agent_worker"):
            for url, c in _dict(values.get("prefix_cache")).items():
                if not isinstance(c, dict):
                    continue
                t = out.setdefault(str(url), {"requests": 0, "prompt_tokens": 0,
                                              "cached_tokens": 0})
                for k in t:
                    t[k] += _num(c.get(k)) or 0
        return out

    @staticmethod
    def _engine(e: dict[str, Any], cache: dict[str, dict[str, int]]) -> dict[str, Any]:
        running, waiting = _num(e.get("running_requests")), _num(e.get("waiting_requests"))
        c = cache.get(str(e.get("url")), {})
        return {"url": e.get("url"), "healthy": e.get("healthy"), "running_requests": running,
                "waiting_requests": waiting, "load": (running or 0) + (waiting or 0),
                "weight_version": e.get("weight_version"),
                "prefix_cache_hit_rate": _hit_rate(c.get("cached_tokens", 0),
                                                   c.get("prompt_tokens", 0))}

    def _eval(self, r: dict[str, Any] | None) -> dict[str, Any] | None:
        """The newest finished evaluation round: the rollouter's summary (pass@k, per
        data_source), else what the trainer reported of it (reward mean and version only)."""
        ev = _dict((r or {}).get("eval"))
        if ev:
            sources = {str(s): {k: f.get(k) for k in ("prompts", "n", "failed", "reward_mean")}
                       | {"pass_at": _dict(f.get("pass_at"))}
                       for s, f in _dict(ev.get("by_source")).items() if isinstance(f, dict)}
            return {"version": ev.get("version"), "prompts": ev.get("prompts"),
                    "n": ev.get("n"), "failed": ev.get("failed"),
                    "reward_mean": ev.get("reward_mean"), "pass_at": _dict(ev.get("pass_at")),
                    "by_source": sources, "pending": (r or {}).get("eval_pending")}
        tr = self._values("trainer") or {}
        if tr.get("eval_version") is None:
            return None  # no round finished yet (or no eval configured)
        return {"version": tr.get("eval_version"), "prompts": None, "n": None, "failed": None,
                "reward_mean": tr.get("eval_reward_mean"), "pass_at": {}, "by_source": {},
                "pending": None}

    def _last_sync(self) -> dict[str, Any] | None:
        s = self._values("synchronizer")
        last = _dict((s or {}).get("last_sync") or (s or {}).get("last"))  # "last": its own name
        if s is None or not last:
            return None  # no sync yet
        out = {**{k: last.get(k) for k in SYNC_KEYS}, "ok": last.get("ok"),
               "syncs": s.get("syncs"), "failures": s.get("failures")}
        parts = [_num(last.get(k)) for k in ("pause_s", "broadcast_s", "resume_s")]
        if out["total_s"] is None and None not in parts:
            out["total_s"] = sum(parts)  # type: ignore[arg-type]
        return out

    @staticmethod
    def _shards(rollouters: list[tuple[int | str, dict[str, Any]]],
                queues: list[tuple[int | str, dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
        """Each shard's own figures and balance (`off`: 0 when it balances; None until it
        reports its accounting), in instance order."""
        def off(parse: Any, v: dict[str, Any]) -> int | None:
            try:
                return parse(v).off
            except StatusError:
                return None

        return {
            "rollouter": [{"instance": i, "admitted": v.get("admitted_samples", 0),
                           "in_flight": v.get("in_flight"), "queued": v.get("queued_samples", 0),
                           "dropped": sum(_counts(v.get("dropped")).values()),
                           "paused": v.get("paused"), "off": off(RolloutStatus.parse, v)}
                          for i, v in rollouters],
            "message_queue": [{"instance": i, "depth": v.get("depth_samples"),
                               "put": v.get("put_samples"),
                               "consumed": v.get("consumed_samples"),
                               "dropped": sum(_counts(v.get("dropped")).values()),
                               "off": off(QueueStatus.parse, v)} for i, v in queues],
        }

    @staticmethod
    def _accounting(rs: list[dict[str, Any]], qs: list[dict[str, Any]]) -> dict[str, Any]:
        """admitted = consumed + dropped + in flight (`accounting.identity`), from the latest
        status of every rollouter and queue instance, summed (`RolloutStatus.combine`,
        `QueueStatus.combine`). The two are heard at different moments, so samples moving
        between them can put it off while nothing is lost; each side's own balance
        (`RolloutStatus.off`, `QueueStatus.off`) tells a leak from that: difference =
        rollouter off + queue off + between. Unknown (None) until every instance of both has
        reported it."""
        try:
            if not rs or not qs:
                raise StatusError("not heard yet")
            r_shards = [RolloutStatus.parse(r) for r in rs]
            q_shards = [QueueStatus.parse(q) for q in qs]
        except StatusError:  # not heard yet, or a status without its accounting (yet)
            return dict.fromkeys(("admitted", "consumed", "dropped_total", "in_flight",
                                  "difference", "holds", "rollouter_balances",
                                  "queue_balances", "between"))
        rollouter, queue = RolloutStatus.combine(r_shards), QueueStatus.combine(q_shards)
        ident = identity(rollouter, queue)
        return {"admitted": ident.admitted, "consumed": ident.consumed,
                "dropped_total": ident.dropped_total, "in_flight": ident.in_flight,
                "difference": ident.difference, "holds": ident.holds,
                # each shard on its own: one off by +1 and another by -1 is two leaks
                "rollouter_balances": all(r.off == 0 for r in r_shards),
                "queue_balances": all(q.off == 0 for q in q_shards),
                "between": rollouter.queued_samples - queue.put_samples}


# -- the dashboard ---------------------------------------------------------------------------------

class HubLink:
    """The monitor's one connection to the run: a SUB socket on the hub, plus an inproc monitor
    of its CURVE handshakes, so wrong keys are reported rather than waited on."""

    def __init__(self, run: Run, keys: CurveKeys, board: StatusBoard):
        self.run, self.board = run, board
        self.refused: str | None = None
        self.transport = Transport(keys)
        self.sub = Subscriber(self.transport, run.hub, topics=TOPICS, secure=True)
        self.events = self.sub.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]

    async def _receive(self) -> None:
        while True:
            topic, rec = await self.sub.recv()
            if isinstance(rec, Metrics):
                self.board.update(topic, rec)

    async def _watch(self) -> None:
        while True:
            event = parse_monitor_message(await self.events.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.refused = None
            elif event["event"] in _HANDSHAKE_FAILED:
                self.refused = _HANDSHAKE_FAILED[event["event"]]

    def problem(self, started: float, wait_s: float) -> str | None:
        """Why nothing will come, once that is known; None while status arrives or may yet."""
        if self.board.received:
            return None
        run = self.run
        if self.refused is not None:
            return (f"the status hub {run.hub} refused the CURVE handshake ({self.refused}): the "
                    f"keys in {run.keys_dir} are not this run's keys (the launcher keeps them in "
                    f"{run.run_dir / 'keys'})")
        if time.monotonic() - started < wait_s:
            return None
        hint = ""
        if run.launcher_pid is not None:
            try:
                os.kill(run.launcher_pid, 0)
            except ProcessLookupError:
                hint = f" (launcher pid {run.launcher_pid} is not running on this host)"
            except OSError:
                pass
        return (f"no status from {run.hub} after {wait_s:g}s: is the run alive{hint}, and are "
                f"{run.keys_dir} the run's keys?")

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(zmq.ZMQError):
            self.sub.sock.disable_monitor()
        self.events.close(0)
        self.sub.close()
        self.transport.close()


async def _collect(link: HubLink, board: StatusBoard, wait_s: float) -> None:
    """--once: until the launcher's status and one status interval more (every role publishes
    about once a second), or `wait_s` if the launcher stays quiet."""
    started = time.monotonic()
    while True:
        problem = link.problem(started, wait_s)
        if problem:
            raise MonitorError(problem)
        now = time.monotonic()
        if board.launcher_first_seen is not None and now >= board.launcher_first_seen + SETTLE_S:
            return
        if board.launcher_first_seen is None and now - started >= wait_s:
            print(f"rollmesh monitor: no launcher status from {link.run.hub} after {wait_s:g}s; "
                  "showing the roles heard", file=sys.stderr)
            return
        await asyncio.sleep(0.05)


@contextlib.contextmanager
def _quit_on_q(stop: asyncio.Event) -> Iterator[None]:
    """`q` on a terminal detaches (cbreak mode: keys arrive unbuffered, Ctrl-C still signals)."""
    if not sys.stdin.isatty():
        yield
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    loop = asyncio.get_running_loop()

    def on_key() -> None:
        if b"q" in os.read(fd, 64).lower():
            stop.set()

    tty.setcbreak(fd)
    loop.add_reader(fd, on_key)
    try:
        yield
    finally:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def _watch_live(link: HubLink, board: StatusBoard, args: argparse.Namespace) -> None:
    """Until q, Ctrl-C or SIGTERM: the dashboard (or, with --json, one snapshot per second)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    started = time.monotonic()

    async def tick(interval: float) -> None:
        problem = link.problem(started, args.wait)
        if problem:
            raise MonitorError(problem)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)

    if args.json:
        while not stop.is_set():
            await tick(1.0)
            if board.received:
                print(json.dumps(board.snapshot(), default=str), flush=True)
        return
    console = Console()
    with _quit_on_q(stop), Live(console=console, auto_refresh=False,
                                redirect_stderr=False) as live:
        while not stop.is_set():
            live.update(render(board.snapshot(), width=console.width, live=True), refresh=True)
            await tick(REFRESH_S)


async def _monitor(run: Run, keys: CurveKeys, args: argparse.Namespace) -> int:
    board = StatusBoard(run)
    link = HubLink(run, keys, board)
    try:
        if not args.once:
            await _watch_live(link, board, args)
            return 0
        await _collect(link, board, args.wait)
        if args.json:
            print(json.dumps(board.snapshot(), default=str), flush=True)
        else:
            console = Console()
            console.print(render(board.snapshot(), width=console.width))
        return 0
    finally:
        await link.close()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="rollmesh monitor",
        description="Attach to a run's status hub (read-only) and show it live. Detach with q "
                    "or Ctrl-C; the run is not touched.")
    p.add_argument("target", metavar="CLUSTER_TOML_OR_RUN_DIR",
                   help="a run directory, or a cluster file (its newest run)")
    p.add_argument("--json", action="store_true",
                   help="snapshots as JSON (one line each) instead of the dashboard")
    p.add_argument("--once", action="store_true", help="show one snapshot and exit")
    p.add_argument("--wait", type=float, default=5.0, metavar="S",
                   help="seconds to wait for the first status before giving up (default 5)")
    p.add_argument("--keys", metavar="DIR", help="CURVE keys (default: RUN_DIR/keys)")
    p.add_argument("--hub", metavar="ADDRESS",
                   help="the hub's subscriber address (default: hub_backend in launcher.json)")
    args = p.parse_args(argv)
    from rollmesh.runtime.log import configure_logging

    # Warnings (a malformed status) on stderr, never inside the JSON or the live dashboard.
    configure_logging("monitor", stream=sys.stderr, level="warning" if args.once else "error")
    try:
        run = load_run(find_run_dir(args.target), keys=args.keys, hub=args.hub)
        try:
            keys = CurveKeys.load(run.keys_dir, "monitor")
        except TransportError as e:
            raise MonitorError(f"{e}: the hub only admits the run's keys "
                               f"({run.run_dir / 'keys'}, or --keys DIR)") from None
        return asyncio.run(_monitor(run, keys, args))
    except MonitorError as e:
        print(f"rollmesh monitor: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
