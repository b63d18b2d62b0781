"""A trainer-like process for the weight-sync test: rank 0 of the weight-update group.

    python trainer_broadcast.py ENGINE_URL MASTER_PORT SPEC VERSION [--bad-name] [--bf16]

Follows the contract's ordering: fire the HTTP call without waiting, join / broadcast, then
collect the reply. Prints one JSON line with the engines' replies.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from bucket_broadcast import post  # the script beside this one (its directory is on sys.path)
from rollmesh.models.loading import build_tiny
from rollmesh.weight_sync.group import destroy_weight_update_group, init_weight_update_group
from rollmesh.weight_sync.tensors import dtype_name


def update_request(
    named_tensors: Sequence[tuple[str, torch.Tensor]],
    weight_version: str,
    group_name: str = "weight_update_group",
    **extra: Any,
) -> dict[str, Any]:
    """The JSON body of `/update_weights_from_distributed` announcing `named_tensors`."""
    return {
        "names": [n for n, _ in named_tensors],
        "dtypes": [dtype_name(t.dtype) for _, t in named_tensors],
        "shapes": [list(t.shape) for _, t in named_tensors],
        "group_name": group_name,
        "weight_version": str(weight_version),
        "flush_cache": True,
        "abort_all_requests": False,
        **extra,
    }


def broadcast_from_trainer(
    group: dist.ProcessGroup,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    device: torch.device | str | None = None,
) -> int:
    """Rank 0: broadcast each tensor in order (the order of the announced `names`).

    `device` is where the collective runs: cpu for gloo, the rank's GPU for nccl (default: the
    tensor's own device). Returns the number of bytes sent.
    """
    sent = 0
    for _, tensor in named_tensors:
        t = tensor.detach()
        if device is not None:
            t = t.to(device)
        t = t.contiguous()
        dist.broadcast(t, src=0, group=group)
        sent += t.numel() * t.element_size()
    return sent


def main() -> None:
    url, port, spec, version = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    bad_name = "--bad-name" in sys.argv
    model, _ = build_tiny(spec)
    named = list(model.named_parameters())
    if "--bf16" in sys.argv:  # what a bf16 trainer sends; the engine casts to its own dtype
        named = [(n, t.detach().to(torch.bfloat16)) for n, t in named]
    if bad_name:
        named = [("not.a.weight", named[0][1]), *named[1:]]
    replies = {}
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(post, url + "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "group_name": "weight_update_group", "backend": "gloo"})
        group = init_weight_update_group("127.0.0.1", port, 0, 2, "weight_update_group", "gloo",
                                         timeout_s=60)
        replies["init"] = joining.result()
        with torch.no_grad():
            updating = pool.submit(post, url + "/update_weights_from_distributed",
                                   update_request(named, version))
            replies["bytes"] = broadcast_from_trainer(group, named)
            replies["update"] = updating.result()
        replies["destroy"] = post(url + "/destroy_weights_update_group",
                                  {"group_name": "weight_update_group"})
    destroy_weight_update_group(group)
    print(json.dumps(replies))


if __name__ == "__main__":
    main()
