"""engine.router in the plan (nothing started): the router beside engine[0], in its port
block, in front of every engine, its URL handed to the agent workers only."""

from __future__ import annotations

import pytest

from rollmesh.engine.auth import EngineKeys
from rollmesh.config import ConfigError, load_cluster
from rollmesh.launcher.host_kinds import make_host
from rollmesh.launcher.plan import build_plan, plan_router, print_plan
from tests.unit.test_gpu_plans import ROOT


def planned(tmp_path, *sets):
    cluster = load_cluster(ROOT / "launch/local.toml", list(sets))
    hosts = {n: make_host(n, c) for n, c in cluster.hosts.items()}
    plan = build_plan(cluster, hosts, str(tmp_path / "r"), engine_keys=EngineKeys("k", "a"))
    return cluster, plan


def test_the_router_is_planned_beside_engine_0_and_only_the_agent_workers_use_it(tmp_path, capsys):
    cluster, plan = planned(tmp_path, 'engine.router="sglang-router"',
                            'engine.router_policy="round_robin"')
    router = plan_router(cluster, plan, str(tmp_path / "r"), EngineKeys("k", "a"))
    engine0 = next(p for p in plan if p.proc.role == "engine")
    assert router is not None and router.host is engine0.host
    assert router.launch.port == engine0.proc.port + 1
    argv = router.launch.argv
    assert argv[1:3] == ["-m", "rollmesh.engine.router"]
    assert argv[argv.index("--api-key-file") + 1].endswith("/keys/engine.token")
    assert "engine-admin" not in " ".join(argv)  # it proxies /generate: the API key only
    engine_argv = engine0.engine.argv
    assert engine_argv[engine_argv.index("--admin-api-key-file") + 1].endswith(
        "/keys/engine-admin.token")
    assert "--api-key" not in argv  # read from the file by the router's wrapper, not on argv
    assert argv[argv.index("--prometheus-port") + 1] == str(engine0.proc.port + 2)
    assert argv[argv.index("--policy") + 1] == "round_robin"
    assert argv[argv.index("--worker-urls") + 1] == f"http://{engine0.host.address}:{engine0.proc.port}"
    workers = [p for p in plan if p.proc.role == "agent_worker"]
    assert workers and all(p.config["router"] == router.url for p in workers)
    assert all("router" not in p.config for p in plan
               if p.proc.role in ("rollouter", "synchronizer", "trainer"))
    print_plan(cluster, plan, str(tmp_path / "r"))
    assert "router (engine.router, on host" in capsys.readouterr().out


def test_without_engine_router_nothing_is_planned(tmp_path):
    cluster, plan = planned(tmp_path)
    assert plan_router(cluster, plan, str(tmp_path / "r"), EngineKeys("k", "a")) is None
    assert all(p.config.get("router") is None for p in plan if p.proc.role == "agent_worker")


def test_the_router_needs_three_ports_per_process(tmp_path):
    with pytest.raises(ConfigError, match="ports.per_process: expected int >= 3"):
        planned(tmp_path, 'engine.router="sglang-router"', "ports.per_process=2")
