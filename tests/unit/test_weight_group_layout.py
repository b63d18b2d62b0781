"""The engines' weight-update group as the launcher plans it: 1 + sum(TP sizes) ranks.

An SGLang engine with TP size t joins the group with t ranks (rank_offset + tp_rank). Before
the launcher passed `engine_tp_sizes` to the trainer, the group had 1 + engines ranks whatever
the TP size, and the first sync of a TP engine hung waiting for ranks that never came.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rollmesh.config import load_cluster
from rollmesh.engine.client import EngineClient
from rollmesh.launcher.host_kinds import make_host
from rollmesh.launcher.plan import build_plan

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "launch" / "gsm8k_gpu.example.toml"


def _plan(tmp_path: Path, engines: int, tp: int):
    cluster_file = tmp_path / "cluster.toml"
    text = EXAMPLE.read_text().replace('experiment = "../configs/gsm8k_grpo.toml"',
                                       f'experiment = "{ROOT / "configs/gsm8k_grpo.toml"}"')
    gpus = list(range(engines * tp))
    text = text.replace("[roles.engine]\nhost = \"gpu-a\"\ncount = 4\ngpus = [0, 1, 2, 3]",
                        f"[roles.engine]\nhost = \"gpu-a\"\ncount = {engines}\ngpus = {gpus}")
    assert f"count = {engines}\ngpus = {gpus}" in text
    cluster_file.write_text(text)
    cluster = load_cluster(cluster_file, [f"engine.count={engines}", f"engine.tp_size={tp}"])
    hosts = {n: make_host(n, c) for n, c in cluster.hosts.items()}
    return build_plan(cluster, hosts, str(tmp_path / "run"))


@pytest.mark.parametrize("engines,tp", [(1, 1), (4, 1), (4, 2), (2, 4), (1, 8), (3, 2)])
def test_group_world_size_and_offsets_follow_the_tp_sizes(tmp_path, engines, tp):
    plan = _plan(tmp_path, engines, tp)
    trainer0 = next(p for p in plan if p.proc.role == "trainer")
    cfg = trainer0.config
    assert cfg["engine_tp_sizes"] == [tp] * engines
    client = EngineClient(cfg["engines"], tp_sizes=cfg.get("engine_tp_sizes"))
    assert client.weight_group_world_size == 1 + engines * tp
    assert client.rank_offsets() == [1 + i * tp for i in range(engines)]
    # each engine is started with as many GPUs as its TP size, and SGLang is told the size
    engine_procs = [p for p in plan if p.proc.role == "engine"]
    assert len(engine_procs) == engines
    for p in engine_procs:
        assert len(p.proc.gpus) == tp
        argv = p.engine.argv
        assert argv[argv.index("--tp-size") + 1] == str(tp)
