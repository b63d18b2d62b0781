"""A trainer-like process for the weight-sync test: rank 0 of the weight-update group.

    python trainer_broadcast.py ENGINE_URL MASTER_PORT SPEC VERSION [--bad-name] [--bf16]

Follows the contract's ordering: fire the HTTP call without waiting, join / broadcast, then
collect the reply. Prints one JSON line with the engines' replies.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from bucket_broadcast import post  # the script beside this one (its directory is on sys.path)
from rollmesh.engine.models import build_tiny
from rollmesh.weights import (
    broadcast_from_trainer,
    destroy_weight_update_group,
    init_weight_update_group,
    update_request,
)


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
