"""Slurm: the hosts of a run from the allocation, its processes as job steps, `--sbatch`.

    hosts     `[slurm]` (or `hosts = "slurm"`) in a cluster file: hosts node0..nodeN-1, the
              allocation's nodes in order (SLURM_JOB_NODELIST through `scontrol show hostnames`),
              GPUs per node from the allocation; outside one (a login node: `--sbatch`,
              `--dry-run`) placeholders <node0>.. of `slurm.nodes`
    placement roles left out of [roles] by rule: engines on the first `slurm.engine_nodes`
              nodes, trainer ranks spread over the rest, every other role on node0; a role
              written out names its nodes (`host = "node1"`)
    steps     each process: `srun --overlap -N1 -n1 -w NODE --export=ALL ...` (SlurmHost), so
              Slurm accounts for it, signals reach it (`scancel --signal` of its step) and
              `scancel JOB` ends the run; the launcher supervises and restarts steps as it does
              processes. A step that asks for GPUs gets them from Slurm (`--gres=gpu:K`, which
              sets CUDA_VISIBLE_DEVICES); the others `--gres=none` on GPU nodes. A process
              with `cpus` pins itself inside its step (rollmesh.runtime.cpus) with `--cpu-bind=none`
              (srun's own binding does not apply to it); its CPUs must be in the step's cpuset,
              the job's CPUs on the node (all of them with `--sbatch`, which asks --exclusive),
              else it exits at start naming the CPUs it has. Without `cpus`, srun binds as the
              cluster's configuration and `srun_options` (e.g. --cpus-per-task) say
    files     keys (CURVE, the engine token), specs and logs live in the run directory, which
              every node must see at the same path: a shared filesystem (NFS, Lustre...).
    sbatch    `rollmesh launch CLUSTER --sbatch`: RUN/slurm/job.sh runs the launcher in the
              allocation; RUN/slurm/job_id; `rollmesh status/monitor/stop RUN` from a login node
"""

from __future__ import annotations

import os
import re
import shlex
import signal as signals
import subprocess
import sys
from pathlib import Path
from typing import Any

from rollmesh.config import HostConfig, SlurmConfig
from rollmesh.config.slurm import (  # noqa: F401 - the allocation, used here and re-exported
    NODE_NAME,
    SlurmError,
    allocation_nodes,
    expand_nodelist,
    gpus_in_allocation,
    in_allocation,
)
from rollmesh.runtime.cpus import ENV as CPUS_ENV
from rollmesh.launcher.hosts import Echo, LocalHost, die_with_parent, pump
from rollmesh.runtime.log import get_logger

log = get_logger("rollmesh.launcher.slurm")

# --------------------------------------------------------------------------------------------
# Job steps
# --------------------------------------------------------------------------------------------


class SlurmHost(LocalHost):
    """A node of the allocation: each process a job step started by srun from the launcher's
    node. Paths are the launcher's (a shared filesystem); the launcher is not the process's OS
    parent (slurmstepd is): no PDEATHSIG, heartbeats tell a role its launcher is gone, and srun
    (dying with the launcher) takes its step with it."""

    local = True  # same paths: the run directory is shared
    same_machine = False  # not children of the launcher, maybe on another node

    def __init__(self, name: str, cfg: HostConfig, srun_options: list[str] | None = None):
        super().__init__(name, cfg)
        self.srun_options = list(srun_options or [])
        self.step_names: dict[int, str] = {}  # srun's local pid -> its step name

    def srun(self, env: dict[str, str], step_name: str = "rollmesh") -> list[str]:
        argv = ["srun", "--overlap", "-N1", "-n1", "-w", self.address, "--export=ALL",
                f"--job-name={step_name}", f"--chdir={self.workdir}", "--kill-on-bad-exit=1",
                "--mem=0"]
        gpus = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
        if gpus:
            argv.append(f"--gres=gpu:{len(gpus)}")  # Slurm picks them, and says which
        elif self.cfg.gpus:
            argv.append("--gres=none")  # else the step would hold every GPU of the node
        if env.get(CPUS_ENV):
            # the process pins itself (rollmesh.runtime.cpus) to the CPUs the cluster file names; srun
            # binding its task to CPUs of its choosing first would only confuse what is shown
            argv.append("--cpu-bind=none")
        return [*argv, *self.srun_options]

    def argv(self, args: list[str], env: dict[str, str], step_name: str = "rollmesh") -> list[str]:
        return [*self.srun(env, step_name), *super().argv(args, env)]

    def local_env(self, env: dict[str, str]) -> dict[str, str]:
        full = super().local_env(env)  # srun --export=ALL hands it on to the step
        if "CUDA_VISIBLE_DEVICES" in env:
            full.pop("CUDA_VISIBLE_DEVICES")  # the step's GPUs are Slurm's choice
        return full

    def start(self, args: list[str], *, env: dict[str, str], log_path: Path,
              echo: Echo | None, label: str) -> subprocess.Popen:
        """srun, dying with the launcher (PDEATHSIG: srun then ends its step), its output (the
        step's) pumped to the log as a local process's is."""
        name = step_name(label)
        proc = subprocess.Popen(die_with_parent(self.argv(args, env, name)),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=self.local_env(env),
                                cwd=self.local_cwd(), start_new_session=True)
        self.step_names[proc.pid] = name
        pump(proc.stdout, log_path, echo, label)
        return proc

    def step_id(self, proc: subprocess.Popen) -> str | None:
        """`JOB.STEP` of the step srun `proc` started (the newest of its name), if it runs."""
        name = self.step_names.get(proc.pid)
        job = os.environ.get("SLURM_JOB_ID")
        if name is None or not job:
            return None
        try:
            out = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i|%j"],
                                 capture_output=True, text=True, timeout=15).stdout
        except (OSError, subprocess.TimeoutExpired):
            return None
        ids = [line.split("|")[0] for line in out.splitlines() if line.endswith(f"|{name}")]
        return max(ids, key=lambda s: int(s.rsplit(".", 1)[-1]), default=None)

    def signal(self, proc: subprocess.Popen, pid: int | None, sig: int) -> None:
        """The signal to the step's task (`scancel --signal`, which srun would turn into a
        cancel of the step); srun exits with it."""
        if proc.poll() is not None:
            return
        step = self.step_id(proc)
        if step is not None:
            name = signals.Signals(sig).name.removeprefix("SIG")
            done = subprocess.run(["scancel", f"--signal={name}", step], capture_output=True,
                                  timeout=15)
            if done.returncode == 0 and sig != signals.SIGKILL:
                return
        if sig == signals.SIGKILL or step is None:
            proc.send_signal(sig)  # srun cancels its step


def step_name(label: str) -> str:
    """A step name from a process label ("node0 agent_worker/1" -> "agent_worker-1")."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", label.split(" ", 1)[-1])


# --------------------------------------------------------------------------------------------
# sbatch
# --------------------------------------------------------------------------------------------


def batch_script(run_dir: Path, cfg: SlurmConfig, launch_args: list[str]) -> str:
    """The batch script: #SBATCH lines from [slurm], then the launcher on the first node."""
    opts = [f"--job-name=rollmesh-{run_dir.name}", f"--nodes={cfg.nodes}",
            "--ntasks-per-node=1", "--exclusive", "--mem=0", "--open-mode=append",
            f"--output={run_dir.resolve() / 'slurm' / 'job.out'}"]
    if cfg.gpus_per_node:
        opts.append(f"--gpus-per-node={cfg.gpus_per_node}")
    for key, value in (("partition", cfg.partition), ("account", cfg.account),
                       ("time", cfg.time)):
        if value:
            opts.append(f"--{key}={value}")
    opts += cfg.sbatch_options
    workdir = cfg.workdir or os.getcwd()
    python = cfg.python if os.sep not in cfg.python else str(Path(workdir, cfg.python))
    return "\n".join([
        "#!/bin/bash", *(f"#SBATCH {o}" for o in opts),
        "# written by `rollmesh launch --sbatch`: the launcher, inside the allocation; it",
        "# starts every process of the run as a job step (srun) on the allocation's nodes",
        f"cd {shlex.quote(workdir)}",
        "exec " + shlex.join([python, "-m", "rollmesh", "launch", *launch_args]), ""])


def submit(run_dir: Path, cfg: SlurmConfig, launch_args: list[str], resume: bool = False) -> str:
    """Write RUN/slurm/job.sh and submit it; the job id (also in RUN/slurm/job_id)."""
    if not resume and run_dir.exists():
        raise SlurmError(f"run directory {run_dir} already exists: pick another --run-dir")
    (run_dir / "slurm").mkdir(parents=True, exist_ok=True)
    script = run_dir / "slurm" / "job.sh"
    script.write_text(batch_script(run_dir, cfg, launch_args))
    try:
        out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True,
                             text=True, timeout=60)
    except FileNotFoundError:
        raise SlurmError("sbatch not found: --sbatch needs the Slurm client commands") from None
    if out.returncode != 0:
        raise SlurmError(f"sbatch {script} failed: {out.stderr.strip()}")
    job = out.stdout.strip().split(";")[0]
    (run_dir / "slurm" / "job_id").write_text(job + "\n")
    log.info("submitted", job=job, script=str(script))
    return job


def sbatch_main(args: Any, cluster: Any, run_dir: Path) -> int:
    """`rollmesh launch CLUSTER --sbatch`: submit the launch; print the run directory."""
    if cluster.slurm is None:
        print("rollmesh launch: --sbatch needs a cluster file with [slurm] (or "
              'hosts = "slurm")', file=sys.stderr)
        return 2
    if args.dry_run:
        print(batch_script(run_dir, cluster.slurm, ["..."]))
        return 0
    if args.resume:
        launch = ["--resume", str(run_dir.resolve())]
    else:
        launch = [os.path.abspath(args.cluster), "--run-dir", str(run_dir.resolve())]
    for o in args.overrides:
        launch += ["--set", o]
    if args.quiet:
        launch.append("--quiet")
    try:
        job = submit(run_dir, cluster.slurm, launch, resume=bool(args.resume))
    except (SlurmError, OSError) as e:
        print(f"rollmesh launch: {e}", file=sys.stderr)
        return 1
    print(f"rollmesh: submitted batch job {job}; run directory {run_dir}\n"
          f"  rollmesh status {run_dir}    rollmesh monitor {run_dir}    "
          f"rollmesh stop {run_dir}")
    return 0


def status_of_job(run_dir: Path) -> int | None:
    """`rollmesh status RUN` of a submitted run whose launcher has not started (yet): the
    job's state; None if RUN is no submitted run."""
    job = job_of(run_dir)
    if job is None or (run_dir / "launcher.json").exists():
        return None
    state = job_state(job)
    print(f"run {run_dir}: Slurm job {job} "
          f"{state or 'no longer in the queue (see ' + str(run_dir / 'slurm' / 'job.out') + ')'}"
          "; the launcher has not started")
    return 0 if state else 1


def job_of(run_dir: Path) -> str | None:
    """The Slurm job of a run started with `--sbatch`."""
    try:
        return (run_dir / "slurm" / "job_id").read_text().strip() or None
    except FileNotFoundError:
        return None


def job_state(job: str) -> str | None:
    """PENDING, RUNNING, ... while the job is in the queue; None once it has left it."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T|%R"], capture_output=True,
                             text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def wait_job_gone(job: str, timeout_s: float) -> bool:
    """Wait until the job has left the queue (its batch step, the launcher, has ended)."""
    import time

    deadline = time.monotonic() + timeout_s
    while job_state(job) and time.monotonic() < deadline:
        time.sleep(0.5)
    return job_state(job) is None


def cancel(job: str) -> bool:
    out = subprocess.run(["scancel", job], capture_output=True, text=True, timeout=30)
    return out.returncode == 0


def plan_note(real: bool) -> str:
    return ("" if real else "\n(outside a Slurm allocation: <nodeN> stand for the nodes it will "
            "have; `--sbatch` submits the run)")
