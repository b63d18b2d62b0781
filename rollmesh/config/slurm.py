"""Slurm's side of the cluster file: `[slurm]` (or `hosts = "slurm"`) turns into hosts node0..
nodeN-1 from the allocation (`fill_cluster`, which `load_cluster` calls), and the roles left out
of `[roles]` placed by rule. Running processes as job steps is `rollmesh.launcher.slurm`.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from typing import Any

from rollmesh.config.cluster import SlurmConfig
from rollmesh.config.parse import _Context, _parse_dataclass
from rollmesh.config.roles import default_shards

NODE_NAME = re.compile(r"node\d+$")


class SlurmError(RuntimeError):
    """Slurm is not there, or said no."""


# --------------------------------------------------------------------------------------------
# The allocation
# --------------------------------------------------------------------------------------------


def in_allocation() -> bool:
    return bool(os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_JOB_NODELIST"))


def expand_nodelist(nodelist: str) -> list[str]:
    """`vm[01-03],gpu7` -> its host names, in Slurm's order (`scontrol show hostnames`)."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=30)
    except FileNotFoundError:
        raise SlurmError("scontrol not found: the Slurm client commands are needed "
                         "inside an allocation") from None
    if out.returncode != 0 or not out.stdout.split():
        raise SlurmError(f"scontrol show hostnames {nodelist!r} failed: {out.stderr.strip()}")
    return out.stdout.split()


def gpus_in_allocation(env: dict[str, str] | os._Environ = os.environ) -> int:
    """GPUs per node that the job holds (0 when it holds none)."""
    per_node = env.get("SLURM_GPUS_PER_NODE", "")  # "4" or "a100:4"
    if per_node:
        m = re.search(r"(\d+)$", per_node.split(",")[0])
        if m:
            return int(m.group(1))
    if env.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(env["SLURM_GPUS_ON_NODE"])
    ids = env.get("SLURM_JOB_GPUS") or env.get("SLURM_STEP_GPUS") or ""
    return len([i for i in ids.split(",") if i.strip()])


def allocation_nodes(cfg: SlurmConfig) -> tuple[list[str], bool]:
    """The nodes (host names) and whether they are real: inside an allocation its nodes;
    elsewhere `cfg.nodes` placeholders (a plan for `--dry-run`, or `--sbatch`)."""
    if in_allocation():
        return expand_nodelist(os.environ["SLURM_JOB_NODELIST"]), True
    return [f"<node{i}>" for i in range(cfg.nodes)], False


# --------------------------------------------------------------------------------------------
# The cluster file
# --------------------------------------------------------------------------------------------


def fill_cluster(data: dict[str, Any], ctx: _Context,
                 shape: Callable[[], tuple[int, int, int]]) -> dict[str, Any]:
    """The cluster file's data with [hosts] from the allocation and the roles it left out
    placed by rule (config.load_cluster calls this before validating). `shape()`: the
    experiment's engines, engine tp_size and trainer ranks, read only when a role is placed."""
    data = dict(data)
    raw = data.get("slurm", {})
    if data.get("hosts") == "slurm":
        data.pop("hosts")
    if not isinstance(raw, dict):
        ctx.fail("slurm", f"expected a table, got {raw!r}")
    cfg: SlurmConfig = _parse_dataclass(SlurmConfig, raw, "slurm", ctx)
    data["slurm"] = raw
    given = data.get("hosts", {})
    if not isinstance(given, dict):
        ctx.fail("hosts", f'expected a table or "slurm", got {given!r}')
    strays = [name for name in given if not NODE_NAME.match(name)]
    if strays:
        ctx.fail(f"hosts.{strays[0]}", "with [slurm] the hosts come from the allocation "
                 "(node0, node1, ...): leave [hosts] out and name nodes in [roles]")
    nodes, _ = allocation_nodes(cfg)
    gpus = cfg.gpus_per_node if cfg.gpus_per_node is not None else gpus_in_allocation()
    workdir = cfg.workdir or os.getcwd()
    data["hosts"] = {f"node{i}": {"address": node, "launch": "slurm", "gpus": gpus,
                                  "python": cfg.python, "workdir": workdir, "env": dict(cfg.env)}
                     for i, node in enumerate(nodes)}
    roles = dict(data.get("roles") or {})
    missing = [r for r in ("engine", "rollouter", "agent_worker", "reward_worker",
                           "message_queue", "trainer", "synchronizer") if r not in roles]
    if missing:
        roles.update({r: p for r, p in _placed_by_rule(cfg, len(nodes), gpus, ctx,
                                                       shape()).items()
                      if r in missing})
    data["roles"] = roles
    return data


def _placed_by_rule(cfg: SlurmConfig, n: int, gpus: int, ctx: _Context,
                    shape: tuple[int, int, int]) -> dict[str, list[dict[str, Any]]]:
    engines, tp, ranks = shape
    k = cfg.engine_nodes
    if k and k >= n:
        ctx.fail("slurm.engine_nodes", f"expected at most {n - 1} (the allocation has "
                 f"{n} node{'s' if n != 1 else ''} and the trainer needs one), got {k}")
    engine_nodes = list(range(k)) if k else [0]
    trainer_nodes = list(range(k, n)) if k else [0]
    used = {i: 0 for i in range(n)}  # GPUs handed out per node, in order

    def spread(count: int, on: list[int], per: int) -> list[dict[str, Any]]:
        out = []
        for j, node in enumerate(on):
            c = count // len(on) + (1 if j < count % len(on) else 0)
            if c == 0:
                continue
            p: dict[str, Any] = {"host": f"node{node}", "count": c}
            if gpus:
                p["gpus"] = list(range(used[node], used[node] + c * per))
                used[node] += c * per
            out.append(p)
        return out

    # rollout and queue shards by the size of the allocation (config.roles.default_shards);
    # each rollout shard needs an agent and a reward worker of its own at least
    rollouters, queues = default_shards(n * gpus)
    return {"engine": spread(engines, engine_nodes, tp),
            "trainer": spread(ranks, trainer_nodes, 1),
            "rollouter": [{"host": "node0", "count": rollouters}],
            "message_queue": [{"host": "node0", "count": queues}],
            "synchronizer": [{"host": "node0"}],
            "agent_worker": [{"host": "node0", "count": max(cfg.agent_workers, rollouters)}],
            "reward_worker": [{"host": "node0", "count": max(cfg.reward_workers, rollouters)}]}
