"""The launcher's commands: `rollmesh launch` (main), `rollmesh status RUN` (status_main) and
`rollmesh stop RUN` (stop_main); rollmesh.cli dispatches to them.

`rollmesh launch CLUSTER_TOML` loads the cluster file (rollmesh.config), then either prints the
plan (`--dry-run`, rollmesh.launcher.plan; what this machine lacks for it, such as the model
directory, is warned of after it, where a launch refuses), submits a batch job (`--sbatch`,
rollmesh.launcher.slurm), or runs the Launcher (rollmesh.launcher.launcher) under the console
(rollmesh.launcher.console). `rollmesh stop` asks the launcher over its control socket
(StopRun, CURVE with the run's keys) or signals its pid.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from rollmesh.config import ConfigError, load_cluster
from rollmesh.engine.auth import EngineKeys
from rollmesh.launcher.console import Console
from rollmesh.launcher.launcher import Launcher
from rollmesh.launcher.plan import (
    _make_hosts, build_plan, launcher_affinity, pin_launcher, print_plan,
)
from rollmesh.runtime.log import configure_logging
from rollmesh.wire.messages import Heartbeat, StopRun
from rollmesh.wire.transport import (
    CurveKeys, PeerTimeout, RemoteError, RpcClient, Transport, TransportError,
)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="rollmesh launch",
        description="Start a run. On a terminal: a live progress bar (step/total, ETA, reward, "
                    "staleness, samples/s, last sync, elapsed) under one line per notable "
                    "event (restarts, failures with their log's last lines, failed syncs, "
                    "dropped samples, eval results, the watchdog). Not a terminal: plain lines "
                    "`rollmesh: step S/T ...` every few seconds and the event lines. Logs: "
                    "RUN/logs/*.log, JSON lines.")
    p.add_argument("cluster", nargs="?", help="cluster file (launch/*.toml)")
    p.add_argument("--resume", metavar="RUN",
                   help="go on with the run in this directory after it stopped (a trainer "
                        "that died, Ctrl-C, a lost machine): its configs and keys, the "
                        "trainer's latest checkpoint, the queue's log, the rollouter's journal")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a cluster or experiment key, e.g. staleness.max_staleness=0")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan, start nothing; what this machine lacks for it (the "
                        "model directory, CPUs, the hosts' python) is a warning, not an error")
    p.add_argument("--run-dir", help="the run directory (default <run_dir>/<name>-<timestamp>)")
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--verbose", action="store_true",
                       help="also stream every role's log (and the launcher's) to the terminal, "
                            "human-readable: `HH:MM:SS [host role/i] level event key=value`; "
                            "they always go to RUN/logs/ as JSON lines")
    shown.add_argument("--quiet", action="store_true",
                       help="no progress bar or event lines while it runs: only the run "
                            "directory, a failed role's log tail, and the final progress line "
                            "and summary")
    s = p.add_argument_group("Slurm (a cluster file with [slurm]; see rollmesh.launcher.slurm)")
    s.add_argument("--sbatch", action="store_true",
                   help="submit a batch job that runs this launch inside its allocation")
    s.add_argument("--nodes", type=int, help="with --sbatch: nodes (slurm.nodes)")
    s.add_argument("--gpus-per-node", type=int, help="with --sbatch: GPUs per node")
    s.add_argument("--time", help="with --sbatch: the time limit (slurm.time)")
    s.add_argument("--partition", help="with --sbatch: the partition (slurm.partition)")
    args = p.parse_args(argv)
    from rollmesh.launcher import slurm

    for flag, key in (("nodes", "nodes"), ("gpus_per_node", "gpus_per_node"),
                      ("time", "time"), ("partition", "partition")):
        value = getattr(args, flag)
        if value is not None:
            if not args.sbatch:
                p.error(f"--{flag.replace('_', '-')} goes with --sbatch")
            args.overrides.append(f"slurm.{key}={json.dumps(value)}")
    configure_logging("launcher", stream=sys.stderr)
    if (args.cluster is None) == (args.resume is None):
        p.error("give a cluster file, or --resume RUN (not both)")
    if args.resume and args.run_dir:
        p.error("--resume RUN is the run directory: --run-dir does not go with it")
    # A dry run plans for a machine that may not be this one: what this machine lacks (the
    # model directory, CPUs, the hosts' python) is warned of after the plan, not refused.
    problems: list[ConfigError] | None = [] if args.dry_run else None
    try:
        if args.resume:
            run_dir = _run_dir(args.resume)
            pid = json.loads((run_dir / "launcher.json").read_text()).get("pid")
            if pid and pid != os.getpid() and _pid_alive(pid):
                print(f"rollmesh launch: {run_dir} is still running (launcher pid {pid}): "
                      f"stop it first (rollmesh stop {run_dir})", file=sys.stderr)
                return 2
            cluster = load_cluster(run_dir / "cluster.toml", overrides=args.overrides,
                                   machine_problems=problems)
            if args.overrides:
                _same_shards(cluster, load_cluster(run_dir / "cluster.toml",
                                                   machine_problems=[]))
        else:
            cluster = load_cluster(args.cluster, overrides=args.overrides,
                                   machine_problems=problems)
    except ConfigError as e:
        print(f"rollmesh launch: {e}", file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if not args.resume:
        run_dir = Path(args.run_dir or Path(cluster.run_dir) / f"{cluster.name}-{stamp}")
    if args.sbatch:
        return slurm.sbatch_main(args, cluster, run_dir)
    if cluster.slurm is not None and not args.dry_run and not slurm.in_allocation():
        print("rollmesh launch: the cluster file has [slurm] but this is not inside a Slurm "
              "allocation (no SLURM_JOB_ID): submit it with --sbatch, or run it under salloc",
              file=sys.stderr)
        return 2
    if args.dry_run:
        hosts = _make_hosts(cluster)
        warnings: list[str] = [str(e) for e in problems or ()]
        for host in hosts.values():
            try:
                host.python()
            except FileNotFoundError as e:  # (a LocalHost's) planned as named, warned of
                warnings.append(str(e))
                host.require_python = False  # type: ignore[attr-defined]
        print_plan(cluster, build_plan(cluster, hosts, str(run_dir),
                                       engine_keys=EngineKeys("<the run's engine key>",
                                                              "<the run's admin key>"),
                                       launcher_before=launcher_affinity(cluster)), str(run_dir))
        if cluster.slurm is not None:
            print(slurm.plan_note(slurm.in_allocation()))
        sys.stdout.flush()
        for warning in warnings:
            print(f"rollmesh launch: warning: {warning} (a launch on this machine would stop "
                  "here)", file=sys.stderr)
        return 0
    console = Console(cluster.experiment_config.trainer.total_steps,  # type: ignore[union-attr]
                      verbose=args.verbose, quiet=args.quiet)
    console.info(f"rollmesh: run directory {run_dir}")
    try:
        launcher = Launcher(cluster, run_dir, resume=bool(args.resume), console=console)
    except (FileNotFoundError, ConfigError) as e:  # a host's python that is not there
        # (before bootstrap.sh), engine.router without its package here
        console.stop()
        print(f"rollmesh launch: {e}", file=sys.stderr)
        return 2
    try:
        pin_launcher(cluster, args.cluster or str(run_dir / "cluster.toml"))
        return asyncio.run(launcher.run())
    except ConfigError as e:
        console.stop()
        print(f"rollmesh launch: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as e:  # before any role: run directory, ports, SSH reach
        console.stop()
        print(f"rollmesh launch: {e}", file=sys.stderr)
        return 1


def _same_shards(cluster: Any, saved: Any) -> None:
    """A resumed run keeps its rollout and queue shard counts: each shard's journal or log holds
    its own prompts and groups, and the trainer's hand-outs kept per shard are its shares."""
    for role in ("rollouter", "message_queue"):
        now, before = (sum(p.count for p in getattr(c.roles, role)) for c in (cluster, saved))
        if now != before:
            raise ConfigError("--set", f"roles.{role}.count", f"expected {before} (a resumed run "
                              f"keeps its shard counts: each shard's journal or log is its own), "
                              f"got {now}")


def _run_dir(arg: str) -> Path:
    path = Path(arg)
    if (path / "launcher.json").exists():
        return path
    raise SystemExit(f"rollmesh: {arg}: not a run directory (no launcher.json)")


def status_main(argv: list[str]) -> int:
    """`rollmesh status RUN`: is the launcher alive, and what it last said of its processes."""
    p = argparse.ArgumentParser(prog="rollmesh status")
    p.add_argument("run")
    args = p.parse_args(argv)
    from rollmesh.launcher.slurm import status_of_job

    queued = status_of_job(Path(args.run))  # submitted with --sbatch, not started yet
    if queued is not None:
        return queued
    run = _run_dir(args.run)
    info = json.loads((run / "launcher.json").read_text())
    alive = _pid_alive(info["pid"])
    print(f"run {info['name']} ({run}): launcher pid {info['pid']} "
          f"{'running' if alive else 'not running'}")
    status_file = run / "status.json"
    if status_file.exists():
        status = json.loads(status_file.read_text())
        print(f"state: {status['state']}, elapsed {status['elapsed_s']}s")
        for proc in status["processes"]:
            print(f"  {proc['name']:18s} {proc['host']:10s} {proc['state']:9s} "
                  f"restarts={proc['restarts']} pid={proc['pid']}")
    return 0 if alive else 1


def stop_main(argv: list[str]) -> int:
    """`rollmesh stop RUN`: ask the launcher to shut the run down, and wait for it.

    From any machine that reaches the launcher's control socket (launcher.json's "control")
    and holds the launcher's key (RUN/keys/clients/launcher: only it may stop the run):
    StopRun, then wait until the launcher no longer answers. `--pid`: signal the launcher's process instead
    (this machine only); without either, the socket is tried first and the pid is the
    fallback where the launcher runs here."""
    p = argparse.ArgumentParser(prog="rollmesh stop")
    p.add_argument("run")
    p.add_argument("--timeout", type=float, default=60)
    how = p.add_mutually_exclusive_group()
    how.add_argument("--socket", action="store_true",
                     help="only through the control socket (no fallback to the pid)")
    how.add_argument("--pid", action="store_true",
                     help="only by signalling the launcher's pid (on its machine)")
    args = p.parse_args(argv)
    configure_logging("stop", stream=sys.stderr)
    from rollmesh.launcher import slurm

    job = slurm.job_of(Path(args.run))  # submitted with --sbatch
    if job is not None and not (Path(args.run) / "launcher.json").exists():
        ok = slurm.cancel(job)  # still queued (or its launcher not started): no run to drain
        print(f"rollmesh: cancelled Slurm job {job}" if ok else
              f"rollmesh: scancel {job} failed", file=sys.stdout if ok else sys.stderr)
        return 0 if ok else 1
    run = _run_dir(args.run)
    info = json.loads((run / "launcher.json").read_text())
    if not args.pid:
        try:
            answered = asyncio.run(_stop_over_socket(run, info, args.timeout))
        except (OSError, ValueError, TransportError) as e:
            answered = f"cannot use the control socket: {type(e).__name__}: {e}"
        if answered is True:
            print(f"rollmesh: stopped {info['name']} (through {info['control']})")
            if job is not None:
                slurm.wait_job_gone(job, args.timeout)
            return 0
        if job is not None and not args.socket and slurm.job_state(job):
            # its launcher does not answer: the job's end takes every step with it
            print(f"rollmesh: {answered}; cancelling Slurm job {job}", file=sys.stderr)
            return 0 if slurm.cancel(job) and slurm.wait_job_gone(job, args.timeout) else 1
        if args.socket or not _local_launcher(info):
            print(f"rollmesh: could not stop {args.run} through {info.get('control')}: "
                  f"{answered}", file=sys.stderr)
            return 1
        print(f"rollmesh: {answered}; signalling the launcher's pid instead", file=sys.stderr)
    pid = info["pid"]
    if not _pid_alive(pid):
        print(f"rollmesh: the launcher of {args.run} (pid {pid}) is not running")
        return 1
    why_not = not_the_launcher(pid, info)
    if why_not:
        print(f"rollmesh: not signalling pid {pid}: {why_not}", file=sys.stderr)
        return 1
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _pid_alive(pid):
        print(f"rollmesh: launcher {pid} still running after {args.timeout:g}s", file=sys.stderr)
        return 1
    print(f"rollmesh: stopped {info['name']}")
    return 0


def _local_launcher(info: dict[str, Any]) -> bool:
    """The launcher of this launcher.json runs on this machine (its pid means something here)."""
    control = str(info.get("control", ""))
    host = control.removeprefix("tcp://").rsplit(":", 1)[0]
    from rollmesh.config import is_local_address

    return is_local_address(host) or host == os.uname().nodename


async def _stop_over_socket(run: Path, info: dict[str, Any], timeout_s: float) -> bool | str:
    """StopRun to the launcher's control socket, then wait until it stops answering (its
    socket closes when it exits). True: stopped; else why not."""
    keys = CurveKeys.load(run / "keys", "launcher")  # StopRun is taken from no other key
    with Transport(keys) as t:
        client = RpcClient(t, info["control"], timeout_s=3, retries=1, name="launcher")
        try:
            try:
                await client.request(StopRun(reason=f"rollmesh stop from {os.uname().nodename}"))
            except PeerTimeout:
                return "the launcher did not answer (not running, or not reachable from here)"
            except RemoteError as e:
                return f"the launcher refused: {e}"
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                try:  # a Heartbeat is answered by the control socket while the launcher lives
                    await client.request(Heartbeat(sender="rollmesh-stop", seq=0), timeout_s=2,
                                         retries=0)
                except PeerTimeout:
                    return True
                except RemoteError:
                    continue
            return f"the launcher still answers after {timeout_s:g}s"
        finally:
            client.close()


def not_the_launcher(pid: int, info: dict[str, Any]) -> str | None:
    """Why `pid` is not the launcher launcher.json names (None: it is). A pid is reused once
    its process is gone: the process there must be a rollmesh one that started before the
    launcher wrote `started_at`, which a process given the pid later cannot have."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration) as e:
        return f"cannot read what process it is ({type(e).__name__}: {e})"
    started = boot + ticks / os.sysconf("SC_CLK_TCK")
    if not any(b"rollmesh" in part for part in cmdline):
        return f"it is not a rollmesh process ({b' '.join(cmdline).decode(errors='replace')[:120]!r})"
    if started > float(info.get("started_at", 0)) + 2:  # (btime is whole seconds)
        return ("it started after the run's launcher did (the launcher is gone and its pid "
                "was given to another process)")
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, IndexError):
        return True

