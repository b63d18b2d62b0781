"""The run's keys (`RUN/keys`): made by the launcher before any role starts, one client key
pair per role process, one for the launcher (its control key: the only one `StopRun` is taken
from, which `rollmesh stop` uses) and one for the monitor (`rollmesh.wire.transport.CurveKeys`).

A host reached over SSH is given the server pair, every public key and the secret keys of
the role processes placed on it only: a compromised host cannot speak as a role it does not
run (the trainer, the synchronizer). Likewise the engines' admin key (rollmesh.engine.auth)
goes only to a host that runs an engine, a trainer or the synchronizer. On one machine, and on
a Slurm cluster whose run directory is shared, every process can read every key: the
identities there keep each role to its own messages (a bug, a hostile reward or agent process
confined to its role), not a hostile user.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollmesh.config import ROLE
from rollmesh.engine.auth import ADMIN_KEY_FILE
from rollmesh.runtime.log import get_logger
from rollmesh.wire.keys import CLIENTS, CurveKeys, identity_for

log = get_logger("rollmesh.launcher.keys")

LAUNCHER, MONITOR = "launcher", "monitor"
ADMIN_ROLES = frozenset({"engine", "trainer", "synchronizer"})  # hold the engines' admin key


def identities(plan: list[Any]) -> list[str]:
    """The launcher's key first, the monitor's, then each planned role process's."""
    return [LAUNCHER, MONITOR, *(identity_for(p.proc.role, p.proc.index) for p in plan
                                 if ROLE[p.proc.role].entry)]


def make_keys(directory: Path, plan: list[Any], resume: bool) -> CurveKeys:
    """A new run's keys, or a resumed run's, with a pair for any process it had none for (a
    larger plan, a run made before per-role keys); loaded as the launcher's."""
    names = identities(plan)
    if not resume:
        return CurveKeys.generate(directory, names)
    made = CurveKeys.add_identities(directory, names)
    if made:
        log.info("keys_added", identities=made)
    return CurveKeys.load(directory, LAUNCHER)


def files_for_host(directory: Path, plan: list[Any], host: str) -> list[Path]:
    """The key files a host gets: the server pair, the engine token, every public key, the
    secret keys of its own role processes, and the engines' admin key where it runs a role
    that uses it (ADMIN_ROLES)."""
    here = [p for p in plan if p.proc.host == host]
    own = {identity_for(p.proc.role, p.proc.index) for p in here if ROLE[p.proc.role].entry}
    admin = any(p.proc.role in ADMIN_ROLES for p in here)
    clients = directory / CLIENTS
    return sorted([*(f for f in directory.iterdir()
                     if f.is_file() and (admin or f.name != ADMIN_KEY_FILE)),
                   *clients.glob("*.key"),
                   *(clients / f"{name}.key_secret" for name in sorted(own))])
