"""A TCP relay the tests control, to put a network partition between two roles.

`Relay(target_port)` listens on 127.0.0.1 (its own port, `relay.port`) and forwards every
connection to 127.0.0.1:target_port, in a thread of its own (so it keeps working while the
test's event loop is busy). Modes:

- `black_hole()`: connections are accepted (new ones too) and held open, but nothing is
  forwarded either way, and nothing is closed: what a cut cable or a dropped route looks like to
  TCP (no RST, no FIN; only silence).
- `heal()`: forwarding resumes, on the held connections too (the bytes sent meanwhile arrive,
  as TCP's retransmissions would deliver them).
- `delay(seconds)`: every chunk is forwarded `seconds` after it was read (order kept).

`cut_s()` is how long the last black hole lasted.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections import deque


class Relay:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self.address = f"tcp://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._holes = False
        self._delay_s = 0.0
        self._cut_at: float | None = None
        self._cut_s = 0.0
        self._closed = False
        self._forget = False
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self.connections = 0
        self._thread = threading.Thread(target=self._run, name="relay", daemon=True)
        self._thread.start()

    # -- control -----------------------------------------------------------------------------

    def black_hole(self) -> None:
        with self._lock:
            self._holes = True
            self._cut_at = time.monotonic()

    def heal(self, *, keep_connections: bool = True) -> None:
        """Forward again. keep_connections=False: the connections held in the black hole stay
        dead for good (never forwarded, never closed: a NAT or firewall that forgot them);
        only new connections get through."""
        with self._lock:
            if not keep_connections:
                self._forget = True
            self._holes = False
            if self._cut_at is not None:
                self._cut_s = time.monotonic() - self._cut_at
                self._cut_at = None

    def delay(self, seconds: float) -> None:
        with self._lock:
            self._delay_s = seconds

    def cut_s(self) -> float:
        return self._cut_s

    def close(self) -> None:
        self._closed = True
        self._thread.join(5)
        self._listener.close()
        for a, b in self._pairs:
            a.close()
            b.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the loop ----------------------------------------------------------------------------

    def _run(self) -> None:
        # per socket: chunks read and not yet written to its partner, with their due times
        queued: dict[socket.socket, deque[tuple[float, bytes]]] = {}
        partner: dict[socket.socket, socket.socket] = {}
        waiting: list[socket.socket] = []  # accepted in a black hole: not connected onward yet
        while not self._closed:
            with self._lock:
                holes, delay_s = self._holes, self._delay_s
            with self._lock:
                forget, self._forget = self._forget, False
            if forget:  # the held connections turn into zombies: kept open, never served
                partner.clear()
                queued.clear()
                waiting.clear()
            if not holes:
                for client in waiting:
                    self._join(client, queued, partner)
                waiting.clear()
            # in a black hole nothing is read: the peers' kernel buffers fill, as in a partition
            readers = [self._listener, *(() if holes else partner)]
            ready, _, _ = select.select(readers, [], [], 0.01)
            now = time.monotonic()
            for s in ready:
                if s is self._listener:
                    client, _ = self._listener.accept()
                    self.connections += 1
                    if holes:
                        waiting.append(client)
                        self._pairs.append((client, client))
                    else:
                        self._join(client, queued, partner)
                    continue
                if s not in partner:  # its pair was closed a moment ago
                    continue
                try:
                    data = s.recv(1 << 16)
                except OSError:
                    data = b""
                if not data:  # a side closed: close the pair
                    other = partner.pop(s)
                    partner.pop(other, None)
                    queued.pop(s, None)
                    queued.pop(other, None)
                    s.close()
                    other.close()
                    continue
                queued[partner[s]].append((now + delay_s, data))
            if holes:
                continue  # held: nothing goes anywhere until heal()
            for s, chunks in list(queued.items()):
                while chunks and chunks[0][0] <= now:
                    _, data = chunks.popleft()
                    try:
                        s.sendall(data)
                    except OSError:
                        break

    def _join(self, client: socket.socket, queued: dict, partner: dict) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        for x in (client, upstream):
            x.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            queued[x] = deque()
        partner[client], partner[upstream] = upstream, client
        self._pairs.append((client, upstream))
