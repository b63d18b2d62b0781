"""One device, three ways to share it: which gives the trainer more samples/s?

    python benchmarks/one_device.py [--device cpu|cuda] [--steps 30] [--model PATH|tiny]
                                    [--repeats 1] [--json PATH]

The same experiment launched three times on one device (`rollmesh launch`, the real processes):
  share_gpus async   engine and trainer both resident, rollout never pauses but for the weight
                     sync (max_staleness as the experiment says): today's launch/single_gpu.toml
                     (CPU: launch/local.toml);
  colocated          `colocate = true`: they take turns, the engine gives its KV cache back while
                     the trainer steps (launch/single_gpu_colocated.toml, launch/local_colocated.toml);
  sync_mode          the resident pair with staleness.sync_mode = true (the on-policy baseline).
Reported: samples/s the trainer consumed from its first to its last step (the first step's
wait for a batch, start-up included in none of them), each beside the share_gpus async run of
the same invocation, the device named. On CPU "the device" is this machine's cores, shared by
every role; on a GPU the engine and the trainer share the GPU (the light roles run on the CPU).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.engine_proc import with_repo_on_path  # noqa: E402
from benchmarks.results import row, write  # noqa: E402

FILES = {"cpu": ("launch/local.toml", "launch/local_colocated.toml"),
         "cuda": ("launch/single_gpu.toml", "launch/single_gpu_colocated.toml")}


def launch(cluster: str, steps: int, sets: list[str]) -> float:
    """samples/s consumed by the trainer, from the run's metrics (first to last step)."""
    run_dir = Path(tempfile.mkdtemp(prefix="rollmesh-one-device-")) / "run"
    cmd = [sys.executable, "-m", "rollmesh", "launch", cluster, "--quiet", "--run-dir",
           str(run_dir), "--set", f"trainer.total_steps={steps}", "--set", "rollout.eval_every=0"]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, cwd=REPO, check=True, env=with_repo_on_path(REPO))
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l]
    first, last = rows[0], rows[-1]
    return (last["samples_consumed"] - first["samples_consumed"]) / (last["time"] - first["time"])


def compare(device: str, steps: int, sets: list[str], repeats: int = 1) -> list[dict]:
    """The three modes, interleaved `repeats` times; the best of each is reported."""
    shared, colocated = FILES[device]
    modes = {"share_gpus async": (shared, []), "colocated": (colocated, []),
             "sync_mode": (shared, ["staleness.sync_mode=true"])}
    best = {m: 0.0 for m in modes}
    for _ in range(repeats):
        for mode, (cluster, extra) in modes.items():
            best[mode] = max(best[mode], launch(cluster, steps, [*sets, *extra]))
            print(f"{mode}: {best[mode]:.2f} samples/s", flush=True)
    base = best["share_gpus async"]
    where = "one GPU" if device == "cuda" else "this machine's CPUs"
    return [row(f"samples/s on {where}: {mode}", value, base, "samples/s",
                baseline_name=f"share_gpus async ({shared}), the same invocation",
                higher_is_better=True, target=1.3 if mode == "colocated" else None,
                note=f"{steps} trainer steps, best of {repeats}, {' '.join(sets) or 'defaults'}")
            for mode, value in best.items() if mode != "share_gpus async"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=sorted(FILES), default="cpu")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--model", default=None, help="model.path (default: the experiment's)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--set", action="append", default=[], dest="sets",
                   help="more overrides, as rollmesh launch --set")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args()
    sets = list(args.sets) + ([f"model.path={args.model}"] if args.model else [])
    rows = compare(args.device, args.steps, sets, args.repeats)
    for r in rows:
        print(f"{r['figure']}: {r['rollmesh']:.2f} vs {r['baseline']:.2f} ({r['ratio']:.2f}x)")
    write(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
