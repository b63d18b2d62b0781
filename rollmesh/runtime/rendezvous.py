"""The rendezvous of a torch.distributed group (the trainer's ranks, and the weight-update group
of trainer rank 0 and the engines): a TCPStore that listens on one address only."""

from __future__ import annotations

import errno
import socket
from datetime import timedelta

import torch.distributed as dist

from rollmesh.runtime.log import get_logger

log = get_logger("rollmesh.runtime.rendezvous")


def tcp_store(host: str, port: int, rank: int, world: int, timeout: timedelta) -> dist.TCPStore:
    """The rendezvous store of a torch.distributed group: rank 0 serves it, the others connect.

    torch's own TCPStore server listens on every interface (`*:port`), and nothing in its
    protocol authenticates a client: anyone who reaches the port can read and overwrite the
    group's keys. Rank 0 therefore binds the listening socket itself to `host`, the address
    the other ranks are told to use (127.0.0.1 when every rank and engine is on this machine,
    the trainer host's cluster address otherwise), and hands it to TCPStore. Only an address
    that is not this machine's (a NAT'd name, say) falls back to every interface, with a
    warning naming the port to firewall.
    """
    if rank != 0:
        return dist.TCPStore(host, port, world, False, timeout=timeout)
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted rank 0
        try:
            sock.bind(addr)
        except OSError as e:
            if e.errno != errno.EADDRNOTAVAIL:
                raise OSError(e.errno, f"rendezvous tcp://{host}:{port}: cannot listen: "
                              f"{e.strerror}") from None
            log.warning("rendezvous_on_every_interface", host=host, port=port,
                        reason=f"{host} is not an address of this machine; firewall port "
                               f"{port} to the cluster (see README, Security)")
            sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    # TCPStore owns the descriptor from here (it closes it with the store).
    return dist.TCPStore(host, port, world, True, timeout=timeout, master_listen_fd=sock.detach())
