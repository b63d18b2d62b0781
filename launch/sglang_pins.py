"""SGLang's own requirements, for `bootstrap.sh --sglang`: recorded, and checked with pip.

SGLang pins an exact torch (and transformers, tokenizers, openai, ...). bootstrap.sh installs
torch before everything else, so with --sglang it must install SGLang's torch, or the install
cannot resolve. The requirements of the SGLang release pyproject.toml pins are recorded in
launch/sglang-requirements.txt; tests/unit/test_bootstrap_pins.py holds bootstrap.sh and
pyproject.toml to that file without the network.

    .venv/bin/python launch/sglang_pins.py record    # rewrite sglang-requirements.txt from the
                                                     # pinned release's wheel metadata
    .venv/bin/python launch/sglang_pins.py resolve   # pip's resolver, dry run, in a throwaway
                                                     # venv: bootstrap's torch + .[sglang,test]

Both need PyPI; `resolve` reads GPU wheels' metadata (a few GB through pip's cache with an old
pip; seconds with a recent one, which it installs into the throwaway venv).
"""

from __future__ import annotations

import email.parser
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "launch" / "sglang-requirements.txt"
BOOTSTRAP = ROOT / "launch" / "bootstrap.sh"


def sglang_pin() -> str:
    """The SGLang version pyproject.toml's `sglang` extra pins (`sglang==X`)."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["sglang"]
    pins = [m.group(1) for r in extra if (m := re.fullmatch(r"sglang==([\w.]+)", r.strip()))]
    if len(pins) != 1:
        raise SystemExit(f"pyproject.toml: the sglang extra must pin sglang==X, got {extra}")
    return pins[0]


def bootstrap_torch() -> str:
    """The torch bootstrap.sh installs with --sglang."""
    m = re.search(r"^sglang_torch_version=(\S+)", BOOTSTRAP.read_text(), re.M)
    if not m:
        raise SystemExit(f"{BOOTSTRAP}: no sglang_torch_version=... line")
    return m.group(1)


def record() -> None:
    version = sglang_pin()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary",
                        ":all:", f"sglang=={version}", "-d", tmp], check=True)
        (wheel,) = Path(tmp).glob("sglang-*.whl")
        with zipfile.ZipFile(wheel) as z:
            meta = z.read(f"sglang-{version}.dist-info/METADATA").decode()
    requires = email.parser.Parser().parsestr(meta).get_all("Requires-Dist") or []
    runtime = [r for r in requires if "extra ==" not in r]  # what `pip install sglang` pulls
    RECORD.write_text(
        f"# Requires-Dist of sglang=={version} (its wheel's METADATA, extras left out).\n"
        "# Regenerate: .venv/bin/python launch/sglang_pins.py record\n"
        + "".join(f"{r}\n" for r in runtime))
    print(f"{RECORD}: {len(runtime)} requirements of sglang=={version}")


def resolve() -> int:
    torch = bootstrap_torch()
    with tempfile.TemporaryDirectory() as tmp:
        venv, report = Path(tmp) / "venv", Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        py = str(venv / "bin" / "python")
        subprocess.run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
        # No pip configuration: what a fresh host resolves against PyPI.
        env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
        cmd = [py, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", str(report), f"torch=={torch}", "-e", f"{ROOT}[sglang,test]"]
        print("$", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, env=env).returncode
        if rc == 0:
            installs = json.loads(report.read_text())["install"]
            got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in installs}
            print(f"resolved: {len(got)} packages; " + ", ".join(
                f"{k} {got[k]}" for k in ("torch", "sglang", "transformers", "tokenizers",
                                          "openai") if k in got))
        return rc


if __name__ == "__main__":
    commands = {"record": record, "resolve": resolve}
    if len(sys.argv) != 2 or sys.argv[1] not in commands:
        raise SystemExit(f"usage: {sys.argv[0]} record|resolve")
    sys.exit(commands[sys.argv[1]]() or 0)
