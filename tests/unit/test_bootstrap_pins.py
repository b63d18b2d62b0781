"""`bootstrap.sh --sglang` installs a set pip can resolve: its torch is the one SGLang pins, and
rollmesh's own requirements admit every exact pin of SGLang's. Checked against SGLang's recorded
requirements (launch/sglang-requirements.txt, `launch/sglang_pins.py record`), without the
network; `launch/sglang_pins.py resolve` runs pip's resolver itself."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("sglang_pins", ROOT / "launch" / "sglang_pins.py")
sglang_pins = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sglang_pins)

LINUX_X86 = {"sys_platform": "linux", "platform_machine": "x86_64", "platform_system": "Linux",
             "python_version": "3.11", "python_full_version": "3.11.7",
             "implementation_name": "cpython", "os_name": "posix", "extra": ""}


def recorded() -> tuple[str, list[Requirement]]:
    text = sglang_pins.RECORD.read_text()
    version = re.search(r"Requires-Dist of sglang==(\S+) ", text).group(1)
    reqs = [Requirement(line) for line in text.splitlines()
            if line.strip() and not line.startswith("#")]
    return version, [r for r in reqs if r.marker is None or r.marker.evaluate(LINUX_X86)]


def exact_pin(req: Requirement) -> str | None:
    pins = [s.version for s in req.specifier if s.operator == "=="]
    return pins[0] if pins else None


def test_the_record_is_of_the_pinned_release():
    version, _ = recorded()
    assert sglang_pins.sglang_pin() == version


def test_bootstrap_installs_the_torch_sglang_pins():
    _, reqs = recorded()
    (torch,) = [r for r in reqs if canonicalize_name(r.name) == "torch"]
    assert exact_pin(torch) == sglang_pins.bootstrap_torch(), (
        f"SGLang requires {torch}; bootstrap.sh --sglang installs torch=="
        f"{sglang_pins.bootstrap_torch()}: set sglang_torch_version")


def test_rollmesh_requirements_admit_sglangs_exact_pins():
    """A requirement of rollmesh (or of its test extra, installed with it by `--test
    --sglang`) that excludes SGLang's exact pin of the same package cannot resolve."""
    _, reqs = recorded()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ours = [Requirement(r) for r in project["dependencies"]
            + project["optional-dependencies"]["test"]]
    pins = {canonicalize_name(r.name): exact_pin(r) for r in reqs if exact_pin(r)}
    checked = 0
    for req in ours:
        pin = pins.get(canonicalize_name(req.name))
        if pin is not None:
            assert req.specifier.contains(pin, prereleases=True), (
                f"pyproject.toml requires {req}; sglang=={sglang_pins.sglang_pin()} pins "
                f"{req.name}=={pin}")
            checked += 1
    assert checked >= 3  # torch, transformers, tokenizers, openai at least overlap today


@pytest.mark.parametrize("args,torch", [("--sglang", "2.14.1"), ("--test", "2.13.0"),
                                        ("", "2.13.0")])
def test_bootstrap_picks_the_torch_for_its_options(tmp_path: Path, args: str, torch: str):
    """The torch-choosing lines of bootstrap.sh, run with pip and python stubbed out."""
    script = sglang_pins.BOOTSTRAP.read_text()
    start = script.index("extras=\"\"")
    end = script.index('pip install -e ".${extras:+[$extras]}"')
    stub = tmp_path / "venv" / "bin"
    stub.mkdir(parents=True)
    (stub / "python").write_text("#!/bin/sh\n"
                                 "case \"$1\" in -c) exit 1 ;; esac\n"  # torch not importable
                                 "shift 2; echo \"pip $*\"\n")  # `python -m pip ...`
    (stub / "python").chmod(0o755)
    body = script[start:end].replace('python3 -m venv "$venv"', "true")
    out = subprocess.run(["bash", "-c", f"set -euo pipefail; venv={tmp_path / 'venv'}\n{body}",
                          "bootstrap", *args.split()], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"}, check=True).stdout
    assert f"torch=={torch}" in out, out
