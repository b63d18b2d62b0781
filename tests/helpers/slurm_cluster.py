"""A private one-node Slurm cluster on this machine, for the launcher's Slurm tests.

Debian's `slurm-wlm` and `munge` packages: a munged of its own (as user munge, a key generated
per cluster, its own socket), `slurmctld` and `slurmd` in the foreground with a minimal
slurm.conf of their own (own ports, state and spool directories under one temporary folder,
SlurmUser=root, no cgroups: proctrack/linuxproc and task/none; CPUs=2 and CR_Core, steps
overlap). Clients find it through SLURM_CONF (`Slurm.env`). `Slurm.unavailable()` says why a
test must skip: the packages are missing (.ci/run installs them) or this is not root.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

MUNGED = shutil.which("munged") or "/usr/sbin/munged"
SLURMCTLD = shutil.which("slurmctld") or "/usr/sbin/slurmctld"
SLURMD = shutil.which("slurmd") or "/usr/sbin/slurmd"


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class Slurm:
    """`Slurm()` starts the cluster (munged, slurmctld, slurmd) and waits for its node to be
    idle; `stop()` cancels every job and stops the daemons."""

    def __init__(self, cpus: int = 2):
        # Not under pytest's tmp_path: user munge must reach its directory (root's 0700 tmp).
        self.dir = Path(tempfile.mkdtemp(prefix="rollmesh-slurm-"))
        self.dir.chmod(0o755)
        self.node = socket.gethostname()
        self.procs: list[subprocess.Popen] = []
        self.logs: list = []
        try:
            self._start_munge()
            self._write_conf(cpus)
            self._start_slurm()
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def unavailable() -> str | None:
        missing = [p for p in (MUNGED, SLURMCTLD, SLURMD) if not os.path.exists(p)]
        if missing:
            return f"no {', '.join(missing)} (install slurm-wlm and munge; .ci/run does)"
        if not all(shutil.which(c) for c in ("srun", "sbatch", "squeue", "scancel", "scontrol")):
            return "the Slurm client commands are missing (install slurm-wlm)"
        if os.geteuid() != 0:
            return "a private Slurm cluster needs root (slurmd starts jobs as their users)"
        try:
            pwd.getpwnam("munge")
        except KeyError:
            return "no user munge (install munge)"
        return None

    @property
    def env(self) -> dict[str, str]:
        """What a client (srun, sbatch, squeue, the launcher) needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def _spawn(self, name: str, argv: list[str], **kw) -> subprocess.Popen:
        log = open(self.dir / f"{name}.out", "wb")
        self.logs.append(log)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, **kw,
                                env={**os.environ, **self.env} if hasattr(self, "conf") else None)
        self.procs.append(proc)
        return proc

    def _start_munge(self) -> None:
        m = self.dir / "munge"
        m.mkdir()
        m.chmod(0o711)  # munged: the socket directory must be searchable by all
        munge = pwd.getpwnam("munge")
        self.munge_key = m / "munge.key"
        self.munge_key.write_bytes(os.urandom(1024))
        self.munge_key.chmod(0o400)
        for p in (m, self.munge_key):
            os.chown(p, munge.pw_uid, munge.pw_gid)
        self.munge_socket = m / "munge.socket"
        self._spawn("munged", [MUNGED, "--foreground",
                               f"--socket={self.munge_socket}", f"--key-file={self.munge_key}",
                               f"--pid-file={m / 'munged.pid'}", f"--log-file={m / 'munged.log'}",
                               f"--seed-file={m / 'munged.seed'}"],
                    user=munge.pw_uid, group=munge.pw_gid, extra_groups=[])
        self._wait(lambda: self.munge_socket.exists(), "munged", self.dir / "munged.out", 10)

    def _write_conf(self, cpus: int) -> None:
        ctld_port, slurmd_port, srun_lo = _free_ports(3)
        for d in ("state", "spool"):
            (self.dir / d).mkdir()
        mem = 1024
        self.conf = self.dir / "slurm.conf"
        self.conf.write_text("\n".join([
            "ClusterName=rollmesh-test", f"SlurmctldHost={self.node}",
            f"SlurmctldPort={ctld_port}", f"SlurmdPort={slurmd_port}",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "CredType=cred/munge",
            f"StateSaveLocation={self.dir / 'state'}", f"SlurmdSpoolDir={self.dir / 'spool'}",
            f"SlurmctldPidFile={self.dir / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.dir / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.dir / 'slurmctld.log'}",
            f"SlurmdLogFile={self.dir / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "MpiDefault=none", "ReturnToService=2", "MailProg=/bin/true",
            "SchedulerType=sched/backfill", "KillWait=5", "InactiveLimit=0",
            "SlurmctldTimeout=30", "SlurmdTimeout=30", "MessageTimeout=10",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem} State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=FORCE:4", ""]))

    def _start_slurm(self) -> None:
        self._spawn("slurmctld", [SLURMCTLD, "-D", "-c", "-f", str(self.conf)])
        self._spawn("slurmd", [SLURMD, "-D", "-f", str(self.conf), "-N", self.node])

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True,
                                 text=True, env={**os.environ, **self.env})
            return out.returncode == 0 and out.stdout.strip().rstrip("*") in ("idle", "mixed")

        self._wait(idle, "the Slurm node", self.dir / "slurmd.log", 30)

    def _wait(self, ready, what: str, log: Path, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{Path(p.args[0]).name} "
                                       f"exited with {p.returncode} while {what} started: "
                                       f"{self.tail(log)}")
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{what} not ready after {timeout_s:g}s: {self.tail(log)}")

    @staticmethod
    def tail(path: Path, n: int = 1500) -> str:
        try:
            return path.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return f"(no {path})"

    def run(self, *argv: str, check: bool = True, timeout_s: float = 30) -> str:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s,
                             env={**os.environ, **self.env})
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {out.returncode}: {out.stderr[-800:]}")
        return out.stdout

    def jobs(self) -> list[str]:
        """Job ids in the queue, in any state."""
        return self.run("squeue", "-h", "-o", "%i", check=False).split()

    def steps(self) -> list[tuple[str, str]]:
        """(step id, step name) of every running step."""
        out = self.run("squeue", "-h", "-s", "-o", "%i|%j", check=False)
        return [tuple(line.split("|", 1)) for line in out.splitlines() if "|" in line]

    def stop(self) -> None:
        if hasattr(self, "conf") and any(p.poll() is None for p in self.procs):
            try:
                self.run("scancel", "--full", "-u", "root", check=False, timeout_s=10)
                deadline = time.monotonic() + 20
                while self.jobs() and time.monotonic() < deadline:
                    time.sleep(0.3)
            except (subprocess.TimeoutExpired, OSError):
                pass
        for p in reversed(self.procs):  # slurmd, slurmctld, then munged
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for log in self.logs:
            log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
