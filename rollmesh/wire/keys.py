"""The run's keys and who holds them: CURVE key pairs (one server pair per run, one client pair
per identity: each role process, the launcher, the monitor), the names ZAP gives connections,
and the role an identity belongs to. `rollmesh.wire.transport` makes the sockets with them."""

from __future__ import annotations

import contextvars
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85


class TransportError(RuntimeError):
    """A socket could not be set up as asked (e.g. a non-loopback address without keys)."""


CLIENTS = "clients"  # the run's keys directory holds one client key pair per identity here
_IDENTITY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")
# Who sent the request a handler is serving: the CURVE identity (a key pair's name) of the
# peer, set by RpcServer for each request; None on a socket without CURVE.
SENDER: contextvars.ContextVar[str | None] = contextvars.ContextVar("sender", default=None)


def identity_for(role: str, instance: int) -> str:
    """The key pair a role process holds: `<role>-<instance>` (its log file's name too)."""
    return f"{role}-{instance}"


def role_of(identity: str) -> str:
    """`trainer-0` -> `trainer`; an identity without an instance (`launcher`, `monitor`) is
    its own role."""
    head, _, tail = identity.rpartition("-")
    return head if head and tail.isdigit() else identity


def sender_of(frame: Any) -> str | None:
    """The CURVE identity ZAP gave the connection a frame came in on; None without one."""
    try:
        return frame.get("User-Id") or None
    except (zmq.ZMQError, AttributeError, TypeError):
        return None


@dataclass(frozen=True)
class CurveKeys:
    """A run's keys: one server key pair (every bound socket) and one client key pair per
    identity (each role process, the launcher, the monitor), under `clients/`.

    A process loads the server pair and its own client pair. A bound socket admits any
    identity of the run and knows which one sent each message (ZAP's User-Id, `sender_of`),
    so each server can say which roles may send it what (`RpcServer(allow=...)`). A process
    without a key of the run cannot connect to a CURVE socket of the run. Files are written
    mode 0600 in a 0700 directory.
    """

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    directory: Path
    identity: str = "client"

    @classmethod
    def generate(cls, directory: str | Path, identities: Any = ("client",)) -> CurveKeys:
        """A new run's keys, with a client pair for each of `identities`; loaded as the first."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        zmq.auth.create_certificates(str(directory), "server")
        for path in directory.iterdir():
            if path.is_file():
                os.chmod(path, 0o600)
        identities = list(identities)
        cls.add_identities(directory, identities)
        return cls.load(directory, identities[0] if identities else "client")

    @staticmethod
    def add_identities(directory: str | Path, identities: Any) -> list[str]:
        """A client key pair for each identity that has none yet (a new role process, a run
        made before per-role keys); returns those made."""
        clients = Path(directory) / CLIENTS
        clients.mkdir(mode=0o700, exist_ok=True)
        made = []
        for name in identities:
            if not _IDENTITY.fullmatch(name):
                raise TransportError(f"key identity {name!r}: expected letters, digits, "
                                     "'_', '.' or '-'")
            if (clients / f"{name}.key_secret").exists():
                continue
            zmq.auth.create_certificates(str(clients), name)
            for suffix in (".key", ".key_secret"):
                os.chmod(clients / f"{name}{suffix}", 0o600)
            made.append(name)
        return made

    @classmethod
    def load(cls, directory: str | Path, identity: str = "client") -> CurveKeys:
        directory = Path(directory)
        try:
            spub, ssec = zmq.auth.load_certificate(str(directory / "server.key_secret"))
        except (OSError, ValueError) as e:
            raise TransportError(f"cannot load CURVE keys from {directory}: {e}") from None
        try:
            cpub, csec = zmq.auth.load_certificate(
                str(directory / CLIENTS / f"{identity}.key_secret"))
        except (OSError, ValueError) as e:
            raise TransportError(
                f"{directory}: no client key for {identity!r} ({e}); a run's keys hold one "
                f"pair per role process under {CLIENTS}/ (a run made before per-role keys "
                "gets them when resumed)") from None
        if ssec is None or csec is None:
            raise TransportError(f"{directory}: secret keys missing")
        return cls(spub, ssec, cpub, csec, directory, identity)


class RunAuthenticator(ThreadAuthenticator):
    """ZAP for the run's sockets: admits the client keys in `clients/`, and gives each
    connection its key's name as User-Id. A key it does not know makes it read the directory
    again if it changed since (a role process started later: its pair is made at spawn).
    ZeroMQ does not reconnect after a refused handshake, so a key must be known, or on
    disk, by its first connection."""

    def __init__(self, ctx: zmq.Context, clients: Path):
        super().__init__(ctx)
        self.clients = clients
        self.names: dict[bytes, str] = {}
        self._seen: int | None = None  # the directory's mtime at the last read

    def _mtime(self) -> int | None:
        try:
            return self.clients.stat().st_mtime_ns
        except OSError:
            return None

    def load(self) -> None:
        self._seen = self._mtime()
        names = {}
        for path in self.clients.glob("*.key"):
            try:
                public, _ = zmq.auth.load_certificate(str(path))
            except (OSError, ValueError):
                continue
            names[public] = path.name[:-len(".key")]
        self.names = names

    def callback(self, domain: str, z85_key: bytes) -> bool:
        """pyzmq's credentials provider: is this a key of the run?"""
        if z85_key not in self.names and self._mtime() != self._seen:
            self.load()
        return z85_key in self.names

    def curve_user_id(self, client_public_key: bytes) -> str:
        key = z85.encode(client_public_key) if len(client_public_key) == 32 else client_public_key
        return self.names.get(key, "unknown")
