"""Where processes run: this machine, or another one over OpenSSH; and where their output goes.

`LocalHost` starts a command as a child process. `SshHost` starts it through the OpenSSH client
with `BatchMode` (never a password prompt), `ConnectTimeout`, `ServerAliveInterval`, a control
master shared by every process of the run (one TCP connection per host), and host-key checking
left as the user's ssh configuration has it (on, for a fixed fleet). The remote command is one
properly quoted shell line: `cd WORKDIR && exec env K=V ... PYTHON -m rollmesh ...`.

Each process's output (JSON log lines) is pumped by a thread into its own log file and, when an
`echo` is given, handed to it line by line (the launcher's console: rollmesh.launcher.console, which
shows them human-readable with a host and role prefix under --verbose).
"""

from __future__ import annotations

import base64
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from abc import ABC, abstractmethod
from typing import IO, Callable

from rollmesh.config.cluster import HostConfig
from rollmesh.launcher.console import render_line

Echo = Callable[[str, str], None]  # (label, line)


class Host(ABC):
    """A machine of the cluster file."""

    local = True  # its processes see this machine's paths (the run directory) as they are
    same_machine = True  # they run here, as the launcher's children (False: SSH, Slurm)

    def __init__(self, name: str, cfg: HostConfig):
        self.name, self.cfg = name, cfg
        self.workdir = cfg.workdir or os.getcwd()

    @property
    def address(self) -> str:
        return self.cfg.address

    def python(self) -> str:
        return self.cfg.python

    @abstractmethod
    def argv(self, args: list[str], env: dict[str, str]) -> list[str]:
        """The command to start here: `args` starting with "-" run under the host's Python."""

    def start(self, args: list[str], *, env: dict[str, str], log_path: Path,
              echo: Echo | None, label: str) -> subprocess.Popen:
        """Start `PYTHON args...` (or a full argv for non-Python servers) on this host."""
        proc = subprocess.Popen(self.start_argv(args, env), stdin=self.stdin,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=self.local_env(env), cwd=self.local_cwd(),
                                start_new_session=True)  # Ctrl-C reaches the launcher only
        pump(proc.stdout, log_path, echo, label)
        return proc

    stdin = subprocess.DEVNULL

    def start_argv(self, args: list[str], env: dict[str, str]) -> list[str]:
        """`argv` dying with the launcher (Linux): a kill -9 of the launcher must leave no
        process behind, and an engine has no parent heartbeat of its own (roles have both)."""
        return die_with_parent(self.argv(args, env))

    def local_env(self, env: dict[str, str]) -> dict[str, str]:
        return dict(os.environ)

    def local_cwd(self) -> str | None:
        return None

    @abstractmethod
    def signal(self, proc: subprocess.Popen, pid: int | None, sig: int) -> None:
        """Send `sig` to the process (`pid` is its id on the host, from its Hello)."""

    @abstractmethod
    def put_file(self, path: str, data: bytes) -> None:
        """Write a private file (mode 0600) at `path`, relative to the work directory."""

    @abstractmethod
    def read_from(self, path: str, offset: int) -> bytes:
        """The bytes of the file at `path` (relative to the work directory) from `offset` on;
        nothing if the file does not exist (yet)."""


# Run before the real command, in the same process: ask for SIGTERM when the parent (the
# launcher, or the local ssh client's parent) goes (PR_SET_PDEATHSIG survives the exec), stop at
# once if it has gone already, then exec the command.
_GUARD = ("import ctypes,os,signal,sys;ctypes.CDLL(None).prctl(1,signal.SIGTERM);"
          "os.getppid()==int(sys.argv[1]) or sys.exit(3);os.execvp(sys.argv[2],sys.argv[2:])")


# The remote end of an SSH-started command: run it as a child, and stop it (SIGHUP, SIGKILL
# 10 s later) when stdin ends, i.e. when the ssh session closes (the launcher died, or closed
# it to stop the process); signals are passed on; the exit status is the child's (a signal
# as 128 + its number). Without it a remote engine outlives the session (no tty, no SIGHUP).
_REMOTE_GUARD = """
import os, signal, subprocess, sys, threading
p = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL)
def watch():
    try:
        while os.read(0, 65536):
            pass
    except OSError:
        pass
    if p.poll() is None:
        p.send_signal(signal.SIGHUP)  # a role takes it as its parent lost: stops at once
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
threading.Thread(target=watch, daemon=True).start()
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, lambda n, f: p.poll() is None and p.send_signal(n))
rc = p.wait()
sys.stdout.flush()
os._exit(128 - rc if rc < 0 else rc)  # not sys.exit: the watcher may sit in a read
"""


def die_with_parent(argv: list[str]) -> list[str]:
    """`argv` wrapped so that it gets SIGTERM when this process dies (Linux only; elsewhere
    as it is). Started from the thread that calls this (PDEATHSIG follows the forking thread:
    the launcher starts processes from its event-loop thread, which lives as long as it)."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-c", _GUARD, str(os.getpid()), *argv]


class LocalHost(Host):
    local = True
    # False: a missing `python` is planned as it is named (a dry run, which warns of it)
    require_python = True

    def python(self) -> str:
        p = self.cfg.python
        if os.sep in p:
            full = Path(self.workdir, p)
            if not full.exists() and self.require_python:
                raise FileNotFoundError(f"hosts.{self.name}.python: {full} does not exist "
                                        "(run launch/bootstrap.sh, or set python)")
            return str(full)
        return p

    def argv(self, args: list[str], env: dict[str, str]) -> list[str]:
        return [self.python(), *args] if args and args[0].startswith("-") else args

    def local_env(self, env: dict[str, str]) -> dict[str, str]:
        return {**os.environ, **self.cfg.env, **env}

    def local_cwd(self) -> str | None:
        return self.workdir

    def signal(self, proc: subprocess.Popen, pid: int | None, sig: int) -> None:
        if proc.poll() is None:
            proc.send_signal(sig)

    def put_file(self, path: str, data: bytes) -> None:
        full = Path(self.workdir, path)
        full.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    def read_from(self, path: str, offset: int) -> bytes:
        try:
            with open(Path(self.workdir, path), "rb") as f:
                f.seek(offset)
                return f.read()
        except FileNotFoundError:
            return b""


class SshHost(Host):
    local = False
    same_machine = False

    def __init__(self, name: str, cfg: HostConfig, control_dir: Path | None = None):
        super().__init__(name, cfg)
        self.workdir = cfg.workdir or "."
        # A Unix socket path must stay under 108 bytes: a short per-user directory, not the run's.
        self.control_dir = control_dir or Path(tempfile.gettempdir()) / f"rollmesh-ssh-{os.getuid()}"

    def ssh(self) -> list[str]:
        c = self.cfg
        argv = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10",
                "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=3",
                "-o", "ControlMaster=auto", "-o", f"ControlPath={self.control_dir}/%C",
                "-o", "ControlPersist=60", "-p", str(c.port)]
        for opt in c.ssh_options:
            argv += ["-o", opt]
        if c.identity_file:
            argv += ["-i", os.path.expanduser(c.identity_file), "-o", "IdentitiesOnly=yes"]
        if c.user:
            argv += ["-l", c.user]
        return [*argv, c.address]

    def remote_line(self, args: list[str], env: dict[str, str], guard: bool = False) -> str:
        full_env = {**self.cfg.env, **env}
        cmd = [self.cfg.python, *args] if args and args[0].startswith("-") else args
        if guard:  # ends with the session (see _REMOTE_GUARD)
            cmd = [self.cfg.python, "-c", _REMOTE_GUARD, *cmd]
        assignments = [f"{k}={v}" for k, v in sorted(full_env.items())]
        return (f"cd {shlex.quote(self.workdir)} && exec env "
                + shlex.join([*assignments, *cmd]))

    def argv(self, args: list[str], env: dict[str, str]) -> list[str]:
        return [*self.ssh(), self.remote_line(args, env)]

    # kept open and never written: it closes when the launcher exits or closes it, and the
    # remote guard then stops the command
    stdin = subprocess.PIPE

    def start_argv(self, args: list[str], env: dict[str, str]) -> list[str]:
        return die_with_parent([*self.ssh(), self.remote_line(args, env, guard=True)])

    def start(self, args: list[str], **kw) -> subprocess.Popen:  # type: ignore[override]
        self.control_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        return super().start(args, **kw)

    def run(self, line: str, data: bytes | None = None, timeout_s: float = 30) -> str:
        self.control_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        out = subprocess.run([*self.ssh(), line], input=data, capture_output=True,
                             timeout=timeout_s)
        if out.returncode != 0:
            raise RuntimeError(f"ssh {self.name} ({self.address}): `{line}` failed with "
                               f"{out.returncode}: {out.stderr.decode(errors='replace')[-500:]}")
        return out.stdout.decode()

    def check(self) -> None:
        """Reach the host once, before starting anything: a clear error if ssh cannot."""
        self.run("true")

    def signal(self, proc: subprocess.Popen, pid: int | None, sig: int) -> None:
        if pid:
            try:
                self.run(f"kill -{signal.Signals(sig).name} {int(pid)}", timeout_s=10)
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
        elif sig == signal.SIGTERM and proc.stdin is not None and not proc.stdin.closed:
            proc.stdin.close()  # no remote pid (an engine): the remote guard stops it
        if sig == signal.SIGKILL and proc.poll() is None:
            proc.kill()

    def put_file(self, path: str, data: bytes) -> None:
        quoted = shlex.quote(path)
        self.run(f"cd {shlex.quote(self.workdir)} && umask 077 && "
                 f"mkdir -p \"$(dirname {quoted})\" && base64 -d > {quoted}",
                 data=base64.b64encode(data))

    def read_from(self, path: str, offset: int) -> bytes:
        quoted = shlex.quote(path)
        out = self.run(f"cd {shlex.quote(self.workdir)} && if [ -f {quoted} ]; then "
                       f"tail -c +{int(offset) + 1} {quoted} | base64; fi")
        return base64.b64decode(out)


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def pump(stream: IO[bytes] | None, log_path: Path, echo: Echo | None, label: str) -> threading.Thread:
    """Copy a process's output to its log file (JSON lines, as the process writes them) and
    hand each line to `echo` (the console decides what to show), until it closes."""

    def run() -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as f:
            for raw in iter(stream.readline, b""):
                f.write(raw)
                f.flush()
                if echo is not None:
                    echo(label, raw.decode(errors="replace").rstrip("\n"))

    thread = threading.Thread(target=run, name=f"pump-{label}", daemon=True)
    thread.start()
    return thread


def terminal_echo(lock: threading.Lock | None = None) -> Echo:
    """Every line to stdout, human-readable, prefixed `[host role/i]`."""
    lock = lock or threading.Lock()

    def echo(label: str, line: str) -> None:
        with lock:
            sys.stdout.write(f"[{label}] {render_line(line)}\n")
            sys.stdout.flush()

    return echo

