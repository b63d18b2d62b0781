"""A cluster file's `[settings.<role>]` tables (the MessageQueue's capacity, fsync and compaction,
an agent worker's credits, a reward worker's pool): parsed and checked at load, handed to every
process of the role by the plan, shown by the plan, and read by the role itself."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from rollmesh.engine.auth import EngineKeys
from rollmesh.config import ConfigError, load_cluster, parse_config, to_dict
from rollmesh.launcher.plan import _make_hosts, build_plan, print_plan
from rollmesh.config.settings import (
    COMPACT_FLOOR_BYTES, AgentWorkerSettings, MessageQueueSettings, RewardWorkerSettings,
)
from rollmesh.wire.messages import Metrics, StatsRequest
from rollmesh.launcher.supervisor import Supervisor
from rollmesh.wire.transport import RpcClient, Transport, free_port

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENT = ROOT / "configs" / "tiny_cpu.toml"  # rollout.batch_groups = 4
ROLES = ("engine", "rollouter", "agent_worker", "reward_worker", "message_queue", "trainer",
         "synchronizer")


def cluster_file(tmp_path: Path, settings: str = "") -> Path:
    lines = ['name = "tuned"', f'experiment = "{EXPERIMENT}"',
             "[hosts.local]", 'address = "127.0.0.1"', f'python = "{sys.executable}"']
    for role in ROLES:
        lines += [f"[roles.{role}]", 'host = "local"']
    path = tmp_path / "cluster.toml"
    path.write_text("\n".join(lines) + "\n" + settings)
    return path


TUNED = """
[settings.message_queue]
capacity_groups = 7
fsync_interval_s = 0
compact_floor_bytes = 1048576
max_pending_batches = 3

[settings.agent_worker]
credits = 5

[settings.reward_worker]
pool = 3
"""


def plan_of(cluster, run_dir: Path):
    return {p.name: p for p in build_plan(cluster, _make_hosts(cluster), str(run_dir),
                                          engine_keys=EngineKeys("k", "a"))}


def test_every_process_of_a_role_gets_its_table_and_the_plan_shows_what_changed(tmp_path,
                                                                                 capsys):
    cluster = load_cluster(cluster_file(tmp_path, TUNED))
    plan = plan_of(cluster, tmp_path / "run")
    mq = parse_config(MessageQueueSettings, plan["message_queue[0]"].config, "spec")
    assert (mq.capacity_groups, mq.fsync_interval_s, mq.compact_floor_bytes,
            mq.max_pending_batches) == (7, 0.0, 1 << 20, 3)
    assert mq.state_dir is not None  # the wiring is the launcher's still
    assert parse_config(AgentWorkerSettings, plan["agent_worker[0]"].config, "spec").credits == 5
    assert parse_config(RewardWorkerSettings, plan["reward_worker[0]"].config, "spec").pool == 3

    print_plan(cluster, list(plan.values()), str(tmp_path / "run"))
    lines = capsys.readouterr().out.splitlines()
    head = next(line for line in lines if line.split()[:1] == ["message_queue[0]"])
    assert head.split()[1:] == ["capacity_groups=7", "fsync_interval_s=0.0",
                                "compact_floor_bytes=1048576", "max_pending_batches=3"]
    head = next(line for line in lines if line.split()[:1] == ["agent_worker[0]"])
    assert head.split()[1:] == ["credits=5"]


def test_without_the_tables_the_roles_keep_their_defaults(tmp_path, capsys):
    cluster = load_cluster(cluster_file(tmp_path))
    plan = plan_of(cluster, tmp_path / "run")
    mq = parse_config(MessageQueueSettings, plan["message_queue[0]"].config, "spec")
    assert (mq.capacity_groups, mq.fsync_interval_s, mq.compact_floor_bytes) == \
        (None, 1.0, COMPACT_FLOOR_BYTES)
    assert parse_config(AgentWorkerSettings, plan["agent_worker[0]"].config, "spec").credits == 64
    print_plan(cluster, list(plan.values()), str(tmp_path / "run"))
    head = next(line for line in capsys.readouterr().out.splitlines()
                if line.split()[:1] == ["message_queue[0]"])
    assert head.split() == ["message_queue[0]"]


def test_an_override_sets_a_role_setting(tmp_path):
    cluster = load_cluster(cluster_file(tmp_path),
                           ["settings.message_queue.fsync_interval_s=0.25",
                            "settings.reward_worker.pool=4"])
    assert cluster.settings.message_queue.fsync_interval_s == 0.25
    assert cluster.settings.reward_worker.pool == 4


@pytest.mark.parametrize("settings, key, problem", [
    ("[settings.message_queue]\ncapacity_grups = 8\n", "settings.message_queue.capacity_grups",
     "did you mean 'capacity_groups'?"),
    ("[settings.message_queue]\nfsync_interval_s = -1\n",
     "settings.message_queue.fsync_interval_s", "expected float >= 0, got -1"),
    ("[settings.agent_worker]\ncredits = 0\n", "settings.agent_worker.credits",
     "expected int >= 1, got 0"),
    ("[settings.trainer]\nlr = 1\n", "settings.trainer", "unknown key"),
    # the trainer takes batches of rollout.batch_groups (4) whole: a smaller queue never has one
    ("[settings.message_queue]\ncapacity_groups = 3\n", "settings.message_queue.capacity_groups",
     "expected at least rollout.batch_groups (4 in"),
])
def test_a_bad_setting_is_refused_naming_its_key(tmp_path, settings, key, problem):
    with pytest.raises(ConfigError) as err:
        load_cluster(cluster_file(tmp_path, settings))
    assert err.value.key == key
    assert problem in err.value.problem
    assert str(err.value).startswith(str(tmp_path / "cluster.toml"))


def test_the_launched_queue_runs_with_the_planned_settings(tmp_path):
    """The plan's spec, run by the real role: the queue reports the capacity it was given."""
    cluster = load_cluster(cluster_file(tmp_path, TUNED))
    config = dict(plan_of(cluster, tmp_path / "run")["message_queue[0]"].config)
    config["bind"] = f"tcp://127.0.0.1:{free_port()}"

    async def run() -> dict:
        with Transport() as t:
            sup = Supervisor(t, heartbeat_s=1.0)
            try:
                mq = sup.spawn("message_queue", "rollmesh.mq.role:main", config=config,
                               env={"PYTHONPATH": str(ROOT)})
                address = (await sup.wait_ready(mq, 60))["rpc"]
                client = RpcClient(t, address, timeout_s=10)
                try:
                    reply = await client.request(StatsRequest())
                finally:
                    client.close()
            finally:
                await sup.close()
        assert isinstance(reply, Metrics)
        return reply.values

    values = asyncio.run(run())
    assert values["capacity_groups"] == 7
    assert values["durable"] is True
    assert to_dict(cluster.settings)["message_queue"]["fsync_interval_s"] == 0.0
