"""`engine.max_running_requests` and `engine.extra_args` reach the engine servers.

Both were documented config keys that nothing read: SGLang was never told the running limit,
and the built-in engine dropped `extra_args`.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rollmesh.config import ConfigError, EngineConfig, ModelConfig, load_experiment
from rollmesh.engine.launch import engine_launch

ROOT = Path(__file__).resolve().parents[2]


def test_sglang_is_told_the_running_limit_and_the_extra_args():
    engine = EngineConfig(kind="sglang", max_running_requests=48,
                          extra_args=["--enable-memory-saver", "--chunked-prefill-size", "4096"])
    launch = engine_launch(engine, ModelConfig(path="/models/q"), "0.0.0.0", 30000, gpus=[0])
    argv = launch.argv
    assert argv[argv.index("--max-running-requests") + 1] == "48"
    assert argv[-3:] == ["--enable-memory-saver", "--chunked-prefill-size", "4096"]


def test_builtin_engine_gets_the_extra_args_after_its_own_flags():
    engine = EngineConfig(max_running_requests=5, extra_args=["--threads", "2", "--seed", "9"])
    argv = engine_launch(engine, ModelConfig(path="tiny"), "127.0.0.1", 30000, seed=1).argv
    assert argv[argv.index("--max-running-requests") + 1] == "5"
    assert argv[-4:] == ["--threads", "2", "--seed", "9"]  # a later --seed wins over the run's


@pytest.mark.parametrize("extra,problem", [
    (["--bogus", "1"], "the built-in engine does not take ['--bogus', '1']"),
    (["--seed", "x"], "argument --seed: invalid int value: 'x'"),
])
def test_an_extra_arg_the_builtin_engine_refuses_is_a_config_error(extra, problem):
    with pytest.raises(ConfigError) as e:
        load_experiment(ROOT / "configs/tiny_cpu.toml",
                        overrides=[f"engine.extra_args={json.dumps(extra)}"])
    assert "engine.extra_args" in str(e.value) and problem in str(e.value)


def test_dry_run_shows_both(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "rollmesh", "launch", "launch/local.toml", "--dry-run",
         "--run-dir", str(tmp_path / "r"), "--set", "engine.max_running_requests=7",
         "--set", 'engine.extra_args=["--threads", "1"]'],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = next(l for l in out.stdout.splitlines() if "-m rollmesh engine" in l)
    argv = shlex.split(line)
    assert argv[argv.index("--max-running-requests") + 1] == "7"
    assert argv[-2:] == ["--threads", "1"]


def test_a_started_builtin_engine_honours_an_extra_arg(tmp_path):
    from tests.engine.engine_harness import free_port, repo_env

    port = free_port()
    engine = EngineConfig(max_running_requests=64, extra_args=["--max-running-requests", "3"])
    launch = engine_launch(engine, ModelConfig(path="tiny"), "127.0.0.1", port, seed=0)
    log = open(tmp_path / "engine.log", "w")
    proc = subprocess.Popen(launch.argv, cwd=ROOT, env=repo_env(), stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        info = None
        while time.monotonic() < deadline and info is None:
            assert proc.poll() is None, (tmp_path / "engine.log").read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/get_server_info",
                                            timeout=5) as r:
                    info = json.load(r)
            except OSError:
                time.sleep(0.2)
        assert info is not None, "engine did not answer"
        assert info["max_running_requests"] == 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
