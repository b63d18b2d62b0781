"""The GPU launch files, planned on CPU with --dry-run: what each process would be given.

launch/single_gpu.toml: the built-in engine and the trainer share GPU 0 (`share_gpus`), the
weights go over gloo. launch/gsm8k_8gpu.example.toml: one 8-GPU node, 4 SGLang engines on GPUs
0-3 and 4 NCCL trainer ranks on 4-7. Nothing is started.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from rollmesh.config import ConfigError, load_cluster
from rollmesh.engine.client import EngineClient
from rollmesh.models.loading import materialize
from rollmesh.launcher.host_kinds import make_host
from rollmesh.launcher.plan import build_plan

ROOT = Path(__file__).resolve().parents[2]


def dry_run(cluster: str, run_dir: Path, *sets: str) -> str:
    args = [a for s in sets for a in ("--set", s)]
    out = subprocess.run([sys.executable, "-m", "rollmesh", "launch", cluster, "--dry-run",
                          "--run-dir", str(run_dir), *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert not run_dir.exists()  # nothing started, nothing written
    return out.stdout


def plan_of(cluster_file: str | Path, run_dir: Path, *sets: str):
    cluster = load_cluster(ROOT / cluster_file, sets)
    hosts = {n: make_host(n, c) for n, c in cluster.hosts.items()}
    return {p.name: p for p in build_plan(cluster, hosts, str(run_dir))}


def test_single_gpu_plan_puts_the_engine_and_the_trainer_on_gpu_0(tmp_path):
    out = dry_run("launch/single_gpu.toml", tmp_path / "r")
    engine = shlex.split(next(l for l in out.splitlines() if "-m rollmesh engine" in l))
    assert engine[engine.index("--device") + 1] == "cuda"
    assert engine[engine.index("--dtype") + 1] == "bfloat16"
    assert "engine[0]          gpus=[0]" in out and "trainer[0]         gpus=[0]" in out

    plan = plan_of("launch/single_gpu.toml", tmp_path / "r")
    assert plan["engine[0]"].engine.env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert plan["trainer[0]"].proc.gpus == (0,)
    spec = plan["trainer[0]"].config["experiment"]
    assert spec["sync"]["backend"] == "gloo" and spec["trainer"]["device"] == "cuda"


def test_sharing_a_gpu_needs_gloo_and_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="share_gpus: expected sync.backend = 'gloo'"):
        load_cluster(ROOT / "launch/single_gpu.toml", ["sync.backend=nccl"])
    without = tmp_path / "c.toml"
    without.write_text((ROOT / "launch/single_gpu.toml").read_text()
                       .replace("share_gpus = true", "")
                       .replace('"../configs/single_gpu.toml"',
                                json.dumps(str(ROOT / "configs/single_gpu.toml"))))
    with pytest.raises(ConfigError, match="GPU 0 on host 'local' is given to both engine"):
        load_cluster(without)


def test_sharing_never_gives_one_gpu_to_two_engines(tmp_path):
    two = tmp_path / "c.toml"
    two.write_text((ROOT / "launch/single_gpu.toml").read_text()
                   .replace('"../configs/single_gpu.toml"',
                            json.dumps(str(ROOT / "configs/single_gpu.toml")))
                   .replace("[roles.engine]\nhost = \"local\"\ncount = 1\ngpus = [0]",
                            "[roles.engine]\nhost = \"local\"\ncount = 2\ngpus = [0, 0]"))
    with pytest.raises(ConfigError, match="given to both engine"):
        load_cluster(two, ["engine.count=2"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A local model directory: the example's /models path does not exist on this machine."""
    return materialize("tiny", tmp_path_factory.mktemp("ckpt") / "model")


@pytest.mark.parametrize("engines,tp", [(4, 1), (2, 2)])
def test_8gpu_example_plans_sglang_engines_and_nccl_ranks(tmp_path, checkpoint, engines, tp):
    sets = [f"model.path={checkpoint}", f"engine.count={engines}", f"engine.tp_size={tp}"]
    cluster = (ROOT / "launch/gsm8k_8gpu.example.toml").read_text().replace(
        '"../configs/gsm8k_grpo.toml"', json.dumps(str(ROOT / "configs/gsm8k_grpo.toml"))
    ).replace("[roles.engine]\nhost = \"node\"\ncount = 4",
              f"[roles.engine]\nhost = \"node\"\ncount = {engines}")
    path = tmp_path / "c.toml"
    path.write_text(cluster)
    out = dry_run(str(path), tmp_path / "r", *sets)
    assert out.count("-m sglang.launch_server") == engines
    assert out.count(f"--tp-size {tp}") == engines
    assert out.count("specs/trainer[") == 4 and "over ssh" not in out

    plan = plan_of(path, tmp_path / "r", *sets)
    engine_gpus = [plan[f"engine[{i}]"].engine.env["CUDA_VISIBLE_DEVICES"] for i in range(engines)]
    assert engine_gpus == [",".join(str(i * tp + j) for j in range(tp)) for i in range(engines)]
    assert [plan[f"trainer[{i}]"].proc.gpus for i in range(4)] == [(4,), (5,), (6,), (7,)]
    trainer0 = plan["trainer[0]"].config
    assert trainer0["experiment"]["sync"]["backend"] == "nccl"
    client = EngineClient(trainer0["engines"], tp_sizes=trainer0["engine_tp_sizes"])
    assert client.weight_group_world_size == 1 + engines * tp
    assert client.rank_offsets() == [1 + i * tp for i in range(engines)]


def test_the_colocated_plan_shares_gpu_0_and_tells_the_trainer(tmp_path):
    plan = plan_of("launch/single_gpu_colocated.toml", tmp_path / "r")
    assert plan["engine[0]"].engine.env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert plan["trainer[0]"].proc.gpus == (0,)
    assert plan["trainer[0]"].config["colocate"] is True
    assert load_cluster(ROOT / "launch/single_gpu_colocated.toml").shared_gpus() == ["local:0"]
    assert plan_of("launch/local.toml", tmp_path / "r")["trainer[0]"].config["colocate"] is False
    assert load_cluster(ROOT / "launch/local.toml").shared_gpus() == []


@pytest.mark.parametrize("setting, key", [
    ('sync.pause_mode="in_place"', "sync.pause_mode = 'abort'"),
    ("sync.sync_every=2", "sync.sync_every = 1"),
    ("sync.overlap=true", "sync.overlap = False"),
    ('sync.backend="nccl"', "sync.backend = 'gloo' or sync.transport = 'handles'"),
])
def test_colocated_mode_refuses_what_cannot_take_turns(setting, key):
    sets = [setting, 'sync.transport="broadcast"'] if "nccl" in setting else [setting]
    with pytest.raises(ConfigError, match=f"colocate: expected {key}".replace("(", r"\(")):
        load_cluster(ROOT / "launch/single_gpu_colocated.toml", sets)
    if "nccl" not in setting:  # the resident pair takes it
        load_cluster(ROOT / "launch/single_gpu.toml", sets)
    else:  # by handle (the default, auto, on one host) NCCL is never used
        load_cluster(ROOT / "launch/single_gpu_colocated.toml", [setting])
