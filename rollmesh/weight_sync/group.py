"""The weight-update process group between trainer rank 0 and the engines: join and leave.

The group is built as SGLang, verl and slime build it (see docs/sglang-api.md): a
rendezvous on `tcp://addr:port`, a `PrefixStore(group_name, store)`, and torch's internal
`_new_process_group_helper`, because a process can own only one default WORLD group and the
trainer's WORLD belongs to training. Rank 0 is the trainer; it broadcasts every tensor in the
order of the announced names (`rollmesh.weight_sync.buckets`), and each engine receives them in
the same order.

Trainer side:  `init_weight_update_group(..., rank=0)` (`sender.WeightSender.join_weight_group`).
Engine side:   `init_weight_update_group(..., rank=rank_offset)`, then
`buckets.receive_weights` / `receive_bucket` / `receive_bucket_into`.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    PrefixStore,
    _new_process_group_helper,
)

from rollmesh.runtime.rendezvous import tcp_store


def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "nccl",
    timeout_s: float = 600.0,
) -> dist.ProcessGroup:
    """Join the weight-update group; blocks until all `world_size` ranks have joined.

    Rank 0 hosts the TCPStore, listening on `master_address` only. Call it once per group name
    per process (destroy first to rejoin).
    """
    timeout = timedelta(seconds=timeout_s)
    # rank 0 (the trainer) listens on master_address only, not on every interface: the store
    # is unauthenticated (README, Security). The engines connect as plain TCPStore clients,
    # as SGLang's own rendezvous does.
    store = tcp_store(master_address, master_port, rank, world_size, timeout)
    store.set_timeout(timeout)
    prefix_store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        backend,
        prefix_store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    # What init_process_group does after the same helper call: the identity rank map. Without it
    # torch 2.13 cannot resolve `broadcast(src=0, group=...)` nor destroy the group.
    dist.distributed_c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_weight_update_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)
