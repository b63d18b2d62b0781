"""CPU placement: the CPUs a process may use (`cpus = "0-3"` in a cluster file), applied at start.

    cpulist   Linux's list syntax: CPU ids and ranges, comma-separated ("0-3,8,10-11"); the ids
              are the host's (as in /proc/cpuinfo, `taskset -c`, `lscpu`)
    checked   on a host that is this machine when the cluster file is loaded (config.load_cluster:
              a ConfigError naming the key, the host and the CPUs it has); on any host again when
              the process starts (SSH hosts, Slurm nodes): the process exits with code 2 and a line
              naming the process, the host and the CPUs available there, which the launcher
              reports with the log's tail
    applied   by a prelude the command is wrapped in, `PYTHON -m rollmesh.runtime.cpus CPULIST WHO --
              COMMAND...`: it sets the affinity (sched_setaffinity) and execs the command, so every
              thread the process ever starts runs on those CPUs only; the same for a role, the
              built-in engine and SGLang, on this machine, over SSH and in a Slurm step
    threads   OMP_NUM_THREADS and MKL_NUM_THREADS in the process's environment (torch's intra-op
              threads follow them) and a trainer's torch.set_num_threads: the number of CPUs given,
              unless set explicitly (the host's `env` sets OMP_NUM_THREADS or MKL_NUM_THREADS: kept;
              the built-in engine's `--threads N` in engine.extra_args: it wins over the
              environment). ROLLMESH_CPUS holds the cpulist, for the process's own log line.
    launcher  `launcher_cpus`: the launcher pins its own threads (pin_self); the processes it
              starts on this machine without `cpus` of their own get the launcher's affinity
              from before that (they are not confined to the launcher's CPUs by inheritance)

Available CPUs are the ones a process here may be scheduled on: online, and in its cgroup's
cpuset (a container, a Slurm step). They are measured, not read from files: a thread widens its
own affinity to every CPU and reads back what the kernel granted (the kernel silently drops CPUs
outside the cpuset from an affinity mask: a cpulist naming one would otherwise be half applied).
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Iterable, Mapping

ENV = "ROLLMESH_CPUS"  # the cpulist a process was started with (set by the prelude)
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
EXIT_BAD_CPUS = 2
_MAX_CPUS = 1 << 14  # widest mask the probe asks for (the kernel clips it to its own CPUs)
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


class CpuListError(ValueError):
    """A cpulist that does not parse, or names CPUs a host does not have."""


def parse_cpulist(text: str) -> tuple[int, ...]:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11): sorted, each CPU once."""
    if not isinstance(text, str):
        raise CpuListError(f"expected a cpulist string such as \"0-3,8\", got {text!r}")
    if not text.strip():
        raise CpuListError(f"expected at least one CPU (a cpulist such as \"0-3,8\"), "
                           f"got {text!r}")
    cpus: set[int] = set()
    for part in text.split(","):
        m = _RANGE.fullmatch(part.strip())
        if m is None:
            raise CpuListError(f"expected CPU ids and ranges separated by commas (e.g. "
                               f"\"0-3,8,10-11\"), got {text!r} ({part.strip()!r} is neither)")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise CpuListError(f"expected ranges low-high, got {text!r} ({part.strip()!r} "
                               "runs backwards)")
        if hi >= _MAX_CPUS:
            raise CpuListError(f"expected CPU ids below {_MAX_CPUS}, got {text!r}")
        cpus.update(range(lo, hi + 1))
    return tuple(sorted(cpus))


def format_cpulist(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 3, 8) -> '0-3,8' (the kernel's own way of writing it)."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def supported() -> bool:
    return hasattr(os, "sched_setaffinity")


def _probe() -> frozenset[int]:
    """In the calling thread: widen its affinity to every CPU, read back what was granted."""
    try:
        os.sched_setaffinity(0, range(_MAX_CPUS))
    except OSError:
        pass  # not allowed to change it: what it has is all we know
    return frozenset(os.sched_getaffinity(0))


def available_cpus() -> frozenset[int]:
    """The CPUs a process on this machine may run on (online, in this cgroup's cpuset). Measured
    in a short-lived thread: this process's own affinity is left as it is."""
    if not supported():
        raise CpuListError("CPU placement needs Linux (sched_setaffinity)")
    result: list[frozenset[int]] = []
    t = threading.Thread(target=lambda: result.append(_probe()), name="cpu-probe")
    t.start()
    t.join()
    return result[0]


def missing_problem(cpus: Iterable[int], available: Iterable[int], where: str) -> str | None:
    """None if every CPU of `cpus` is in `available`, else what is wrong, e.g.
    "CPUs 4-7 are not on host 'a', which has CPUs 0-3"."""
    gone = sorted(set(cpus) - set(available))
    if not gone:
        return None
    which = f"CPU {gone[0]} is" if len(gone) == 1 else f"CPUs {format_cpulist(gone)} are"
    return f"{which} not on {where}, which has CPUs {format_cpulist(available) or 'none'}"


def thread_env(cpus: tuple[int, ...], given: Mapping[str, str]) -> dict[str, str]:
    """The environment a pinned process gets: ROLLMESH_CPUS, and the thread counts the `given`
    environment (the host's `env` in the cluster file) does not set itself."""
    n = str(threads_for(cpus, given))
    return {ENV: format_cpulist(cpus), **{k: n for k in THREAD_VARS if k not in given}}


def threads_for(cpus: tuple[int, ...], given: Mapping[str, str]) -> int:
    """Threads for a process on `cpus`: OMP_NUM_THREADS if `given` sets it, else one per CPU."""
    explicit = given.get("OMP_NUM_THREADS", "")
    return int(explicit) if explicit.isdigit() and int(explicit) > 0 else len(cpus)


def pinned(args: list[str], cpus: tuple[int, ...], who: str,
           python: str | None = None) -> list[str]:
    """`args` run through the prelude. `args` starting with "-" are the host Python's (and the
    result is too: the host runs it under its Python); a full argv needs the `python` that runs
    the prelude (which then execs that argv)."""
    prelude = ["-m", "rollmesh.runtime.cpus", format_cpulist(cpus), who, "--"]
    if args and args[0].startswith("-"):
        return [*prelude, *args]
    if python is None:
        raise ValueError("a full argv needs the Python that runs the prelude")
    return [python, *prelude, *args]


def pin_self(cpus: tuple[int, ...]) -> frozenset[int]:
    """Pin every thread of this process to `cpus` (threads started later inherit it); the
    affinity it had before (the main thread's)."""
    before = frozenset(os.sched_getaffinity(0))
    tids = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, FileNotFoundError):
            pass  # a thread that ended meanwhile
    return before


def main(argv: list[str]) -> int:
    """The prelude: `python -m rollmesh.runtime.cpus CPULIST WHO -- COMMAND...`."""
    if len(argv) < 4 or argv[2] != "--":
        print("usage: python -m rollmesh.runtime.cpus CPULIST WHO -- COMMAND...", file=sys.stderr)
        return EXIT_BAD_CPUS
    text, who, command = argv[0], argv[1], argv[3:]
    try:
        cpus = parse_cpulist(text)
        if not supported():
            raise CpuListError("CPU placement needs Linux (sched_setaffinity)")
        available = _probe()  # this process is single-threaded here: its whole affinity
        problem = missing_problem(cpus, available, f"this host ({os.uname().nodename})")
        if problem:
            raise CpuListError(problem)
        os.sched_setaffinity(0, cpus)
    except (CpuListError, OSError) as e:
        print(f"rollmesh: {who}: cpus {text!r}: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_CPUS
    os.environ[ENV] = format_cpulist(cpus)
    if command[0].startswith("-"):
        os.execv(sys.executable, [sys.executable, *command])
    os.execvp(command[0], command)
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
