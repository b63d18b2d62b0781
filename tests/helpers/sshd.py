"""A private OpenSSH server on 127.0.0.1 for the launcher's SSH tests.

Keys are generated per test (a host key, written to a known_hosts file so host-key checking
stays on, and a user key in authorized_keys). `Sshd.unavailable()` says why a test must skip.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sshd:
    def __init__(self, tmp: Path):
        self.dir = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        for name in ("host_key", "id_ed25519"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / name)],
                           check=True)
        (tmp / "authorized_keys").write_text((tmp / "id_ed25519.pub").read_text())
        host_pub = (tmp / "host_key.pub").read_text().split()
        self.known_hosts = tmp / "known_hosts"
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {host_pub[0]} {host_pub[1]}\n")
        self.identity = tmp / "id_ed25519"
        config = tmp / "sshd_config"
        config.write_text("\n".join([
            f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {tmp / 'host_key'}",
            f"AuthorizedKeysFile {tmp / 'authorized_keys'}", "PubkeyAuthentication yes",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
            "StrictModes no", "PermitRootLogin yes", f"PidFile {tmp / 'sshd.pid'}",
            "MaxSessions 64", "MaxStartups 64:30:128", ""]))
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        self.log = open(tmp / "sshd.log", "wb")
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {(tmp / 'sshd.log').read_text()[-500:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("sshd did not start listening")

    @staticmethod
    def unavailable() -> str | None:
        if not os.path.exists(SSHD):
            return f"no sshd at {SSHD} (install openssh-server; .ci/run does)"
        return None

    def host_toml(self, name: str = "remote") -> str:
        """A [hosts.NAME] table that reaches this machine through this sshd."""
        return "\n".join([
            f"[hosts.{name}]", 'address = "127.0.0.1"', f"port = {self.port}",
            f'user = "{getpass.getuser()}"', f'identity_file = "{self.identity}"',
            'launch = "ssh"', f'python = "{sys.executable}"', f'workdir = "{ROOT}"',
            f'ssh_options = ["UserKnownHostsFile={self.known_hosts}"]', ""])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
