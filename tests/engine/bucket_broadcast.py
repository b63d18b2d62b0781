"""A trainer-like process that sends flattened buckets to an engine: rank 0 of the weight-update
group, following the contract's ordering (fire each HTTP call without waiting, join / broadcast,
then collect the reply), with the library's sender (`rollmesh.weight_sync.buckets.BucketSender`).

    python bucket_broadcast.py ENGINE_URL MASTER_PORT STEPS_JSON

STEPS_JSON: a list of updates sent one after another in one group, each
{"spec": tiny spec, "version": str, "bucket_kb": float, "dtype": "float32"|"bfloat16",
 "bad": null | "shape" | "dtype"}. A "bad" update announces (and sends the bytes of) one wrong
shape or a dtype that cannot load into the model, in a single bucket. Prints one JSON line:
{"init": reply, "updates": [[reply per bucket], ...], "bytes": [...], "destroy": reply}.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from rollmesh.models.loading import build_tiny
from rollmesh.weight_sync.buckets import BucketSender, WeightSpec, plan_buckets, update_body
from rollmesh.weight_sync.group import destroy_weight_update_group, init_weight_update_group


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


def update(pool: ThreadPoolExecutor, url: str, group, step: dict) -> tuple[list[dict], int, float]:
    model, _ = build_tiny(step["spec"])
    dtype = getattr(torch, step.get("dtype", "float32"))
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    specs = [WeightSpec(n, dtype, tuple(t.shape)) for n, t in named]
    tensors = dict(named)
    if step.get("bad") == "shape":  # same bytes, the matrix announced transposed
        n, t = named[3]
        specs[3] = WeightSpec(n, dtype, tuple(reversed(t.shape)))
        tensors[n] = t.t().contiguous()
        buckets = [specs]
    elif step.get("bad") == "dtype":  # int32 bytes for a float weight
        specs[3] = WeightSpec(specs[3].name, torch.int32, specs[3].shape)
        buckets = [specs]
    else:
        buckets = plan_buckets(specs, int(step.get("bucket_kb", 64) * 1024))
    sender = BucketSender(group, "flattened_bucket", "cpu", capacity=max(
        (sum(s.nbytes for s in b) for b in buckets if len(b) > 1), default=0))
    replies, sent, start = [], 0, time.monotonic()
    for i, bucket in enumerate(buckets):
        last = i == len(buckets) - 1
        body = update_body(bucket, weight_version=step["version"], load_format="flattened_bucket",
                           flush_cache=last)
        replying = pool.submit(post, url + "/update_weights_from_distributed", body)
        sent += sender.start(sender.pack(bucket, (tensors[s.name] for s in bucket)))
        sender.wait()
        replies.append(replying.result())
    return replies, sent, time.monotonic() - start


def main() -> None:
    url, port, steps = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    out: dict = {"updates": [], "bytes": [], "seconds": []}
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(post, url + "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "group_name": "weight_update_group", "backend": "gloo"})
        group = init_weight_update_group("127.0.0.1", port, 0, 2, "weight_update_group", "gloo",
                                         timeout_s=60)
        out["init"] = joining.result()
        with torch.no_grad():
            for step in steps:
                replies, sent, seconds = update(pool, url, group, step)
                out["updates"].append(replies)
                out["bytes"].append(sent)
                out["seconds"].append(seconds)
        out["destroy"] = post(url + "/destroy_weights_update_group",
                              {"group_name": "weight_update_group"})
    destroy_weight_update_group(group)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
