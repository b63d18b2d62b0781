"""The trainer's ranks among themselves: rank 0's messages to the others, sums, gathers.

K trainer processes form the trainer's own default process group (rank 0 hosts the TCPStore at
the rendezvous address). Objects cross between ranks only as msgpack bytes in a uint8 tensor,
never pickled (`broadcast_object_list` and friends unpickle what they receive). CPU collectives
run on `Ranks.group`: the default group under gloo, an extra gloo group under nccl. With K = 1
nothing here touches torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import msgpack
import torch
import torch.distributed as dist

from rollmesh.runtime.log import get_logger
from rollmesh.runtime.rendezvous import tcp_store

log = get_logger("rollmesh.training.ranks")


@dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    group: dist.ProcessGroup | None = None  # for CPU tensors

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, message: Any = None) -> Any:
        """Rank 0's plain-data `message`, on every rank (the others pass nothing)."""
        if self.world == 1:
            return message
        if self.rank == 0:
            payload = msgpack.packb(message, use_bin_type=True)
            size = torch.tensor([len(payload)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.group)
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            buf = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        return message if self.rank == 0 else msgpack.unpackb(buf.numpy().tobytes(), raw=False)

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks of a CPU tensor."""
        if self.world > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def gather_bytes(self, payload: bytes) -> list[bytes] | None:
        """Every rank's bytes on rank 0 (None elsewhere)."""
        if self.world == 1:
            return [payload]
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), group=self.group)
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if payload:
            mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world)]
        dist.all_gather(parts, mine, group=self.group)
        if self.rank != 0:
            return None
        return [p[:int(s)].numpy().tobytes() for p, s in zip(parts, sizes)]


def init_ranks(rendezvous: str | None, rank: int, world: int, backend: str,
               timeout_s: float = 1800.0) -> Ranks:
    """Join the trainer's default process group (rank 0 hosts the store at `rendezvous`,
    listening on that address only: see `tcp_store`)."""
    if world == 1:
        return Ranks()
    if not rendezvous:
        raise ValueError(f"trainer.ranks = {world}: the trainer spec needs a rendezvous address "
                         "(tcp://host:port)")
    url = urlsplit(rendezvous)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"trainer rendezvous: expected tcp://host:port, got {rendezvous!r}")
    timeout = timedelta(seconds=timeout_s)
    store = tcp_store(url.hostname, url.port, rank, world, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    group = None if backend == "gloo" else dist.new_group(backend="gloo")
    return Ranks(rank, world, group)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a sharded DTensor is all-gathered (a collective: every rank calls)."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def close_ranks(ranks: Ranks) -> None:
    if ranks.world > 1 and dist.is_initialized():
        dist.destroy_process_group()
