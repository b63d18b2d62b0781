"""The Weights & Biases sink (`rollmesh.training.metrics_sink`): a real run in WANDB_MODE=offline, its
offline run directory read back record by record; the missing extra's error.

The offline run file (RUN/wandb/offline-run-*/run-<id>.wandb) is W&B's transaction log: a
LevelDB-style log of `wandb_internal_pb2.Record` protobufs. wandb 0.31 has no Python reader for it
any more (its Go service reads and writes it), so `wandb_records` reads the log format itself and
parses each record with wandb's own protobuf classes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest

from tests.e2e.test_launcher import ROOT

pytest.importorskip("wandb", reason="the optional `wandb` extra is not installed")

WANDB_OFFLINE = ("--set", "metrics.wandb_project=rollmesh-test",
                 "--set", "metrics.wandb_mode=offline")


def wandb_records(path: Path) -> list:
    """Every record of a .wandb file: a 7-byte file header (":W&B", magic 0xBEE1, version 0),
    then 32 KiB blocks of chunks, each a 7-byte header (CRC-32 of type byte + data, uint16
    length, type: 1 full, 2 first, 3 middle, 4 last) and its data; a block's tail shorter than a
    chunk header is padding."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = path.read_bytes()
    assert raw[:4] == b":W&B" and raw[4:6] == (0xBEE1).to_bytes(2, "little"), raw[:7]
    block, pos, parts, records = 32768, 7, b"", []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        crc = int.from_bytes(raw[pos:pos + 4], "little")
        length = int.from_bytes(raw[pos + 4:pos + 6], "little")
        kind = raw[pos + 6]
        data = raw[pos + 7:pos + 7 + length]
        if (kind == 0 and length == 0) or len(data) < length:  # zeroed or torn tail
            break
        assert zlib.crc32(data, zlib.crc32(bytes([kind]))) == crc, f"bad CRC at byte {pos}"
        pos += 7 + length
        parts = data if kind in (1, 2) else parts + data
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def history_rows(records: list) -> list[dict]:
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                         for i in r.history.item})
    return rows


def config_items(records: list) -> dict:
    """The run's config as W&B holds it: {top-level key: value}, from the run record and any
    later config records."""
    config: dict = {}
    for r in records:
        kind = r.WhichOneof("record_type")
        updates = (r.run.config.update if kind == "run"
                   else r.config.update if kind == "config" else ())
        for item in updates:
            config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return config


def wandb_core_pids() -> set[int]:
    pids = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes()
                if b"wandb-core" in cmd and (proc / "stat").read_text().split()[2] != "Z":
                    pids.add(int(proc.name))
            except OSError:
                continue
    return pids


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """Offline, and W&B's own files (settings, caches) under tmp_path, not the user's home."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)


def test_missing_wandb_package_is_a_clear_error_naming_the_extra(tmp_path):
    """`import wandb` fails in this process (as where the extra is not installed): opening the
    sinks says which key asked for it and what to install."""
    code = textwrap.dedent(f"""
        import sys
        sys.modules["wandb"] = None  # `import wandb` raises ModuleNotFoundError
        from pathlib import Path
        from rollmesh.config import ConfigError, load_experiment
        from rollmesh.runtime.log import get_logger
        from rollmesh.training.metrics_sink import MetricsSinks
        exp = load_experiment("configs/tiny_cpu.toml",
                              ["metrics.wandb_project=rollmesh-test", "metrics.wandb_mode=offline"])
        try:
            MetricsSinks.open(exp, Path({str(tmp_path)!r}) / "metrics.jsonl", get_logger())
        except ConfigError as e:
            print("ERROR", e)
            sys.exit(3)
        """)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 3, result.stderr[-3000:]
    assert ("ERROR metrics.wandb_project is set but the `wandb` package is not installed: "
            "pip install 'rollmesh[wandb]'") in result.stdout
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "wandb_run_id").exists()


def test_wandb_failing_mid_run_is_a_warning_not_an_error(tmp_path, wandb_env):
    """W&B's service process dies under the trainer (as when W&B breaks mid-run): logging a row
    warns once and W&B is dropped; the rows after it and `close` go on without raising."""
    code = textwrap.dedent(f"""
        import os, signal, sys, time
        from pathlib import Path
        from rollmesh.config import load_experiment
        from rollmesh.runtime.log import configure_logging
        from rollmesh.training.metrics_sink import MetricsSinks
        log = configure_logging("trainer", json=True)
        exp = load_experiment("configs/tiny_cpu.toml", ["metrics.wandb_project=rollmesh-test"])
        sinks = MetricsSinks.open(exp, Path({str(tmp_path)!r}) / "metrics.jsonl", log)
        sinks.log({{"step": 1, "reward_mean": 0.1}})
        for proc in Path("/proc").iterdir():  # this process's wandb-core service
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\\0")
            except OSError:
                continue
            if any(b"wandb-core" in c for c in cmd) and str(os.getpid()).encode() in cmd:
                os.kill(int(proc.name), signal.SIGKILL)
        time.sleep(1.0)
        for step in range(2, 5):
            sinks.log({{"step": step, "reward_mean": 0.1 * step}})
        sinks.close()
        print("closed", flush=True)
        """)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    failed = [e for e in events if e["event"] == "wandb_failed"]
    assert len(failed) == 1 and failed[0]["step"] == 2 and failed[0]["level"] == "warning"
    assert "closed" in result.stdout


def test_no_wandb_project_never_imports_wandb(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from rollmesh.config import load_experiment
        from rollmesh.runtime.log import get_logger
        from rollmesh.training.metrics_sink import MetricsSinks
        sinks = MetricsSinks.open(load_experiment("configs/tiny_cpu.toml"),
                                  Path({str(tmp_path)!r}) / "metrics.jsonl", get_logger())
        sinks.log({{"step": 1, "reward_mean": 0.5, "group_ids": [1, 2]}})
        sinks.close()
        print("wandb imported:", "wandb" in sys.modules)
        """)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "wandb imported: False" in result.stdout
