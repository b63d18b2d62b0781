"""End to end: asynchronous vs synchronous training, samples/s and the trainer's idle fraction.

    .venv/bin/python benchmarks/e2e.py [--settings sync,1,2] [--overlap off|on|both]
        [--measures admission,oldest_token]
        [--steps 24] [--warmup 4] [--engine-cpus 0] [--trainer-cpus 1] [--other-cpus engine]
        [--median-len 32] [--sigma 1.3] [--max-len 512] [--min-len 4]
        [--batch-groups 4] [--group-size 8] [--keep] [--json PATH]

Each setting is one whole `rollmesh launch` of the tiny CPU experiment (configs/tiny_cpu.toml:
the random `tiny` model, the built-in engine, GRPO with decoupled PPO, a weight sync after every
step), the only differences being the staleness setting:

    sync     staleness.sync_mode = true (max_staleness 0: one batch per weight version, the
             rollout idles while the trainer steps)
    1, 2     staleness.max_staleness = 1 or 2 (asynchronous, partial rollouts across syncs),
             once per rule in --measures (`staleness.measure`: `admission`, the default, bounds
             where generation began and trains what spans more syncs; `oldest_token` drops a
             group whose oldest token is past the bound)

The same in every setting: model, engine, dataset and its order (same seed), batch size, number
of trainer steps (so the same number of samples trained) and the response lengths.

--overlap picks how the trainer syncs: `off` blocking (it waits for each broadcast), `on`
overlapped (`sync.overlap = true`: it sends a snapshot of the weights while it computes the next
step), `both` runs every setting twice, blocking then overlapped, and prints them side by side
(samples/s, trainer idle per sync and its share of a step).

Placement. The cluster file (written per run) places every role on this machine with the CPUs
it may use (`cpus` per role, `launcher_cpus`: rollmesh's own CPU placement, README "CPU
placement"): the engine on --engine-cpus, the trainer on --trainer-cpus, and the light roles
(rollouter, agent and reward workers, MessageQueue, synchronizer) and the launcher on
--other-cpus (default: the engine's cpus, the rollout side: on a cluster they are CPU processes
of the rollout hosts; '' leaves them unpinned). Every thread of a process runs on its CPUs only,
with OMP_NUM_THREADS (and the torch threads) set to that many. The affinity each process
actually got is read back from /proc and printed.

Long tail. Response lengths are drawn once per sample (seeded) from a lognormal (median
--median-len, shape --sigma), clipped to [--min-len, --max-len], and stored in the dataset rows
(`bench_lengths`, one per group member). A tiny agent loop registered for this run only
(`bench_long_tail`, an entry point in a .dist-info on PYTHONPATH; nothing is installed) is
`single_turn` with a per-sample budget: it generates `length - already generated` tokens with
ignore_eos, so a trajectory interrupted by a sync resumes to exactly its length. Every setting
therefore generates the same tokens per sample. (rollmesh's single_turn has one budget for all
rows, and a row's `sampling.max_new_tokens` override is not reduced on resume, so it cannot
express this.) A full run of the three settings takes about 2-3 minutes on 2 quiet cores.

Measured, from the trainer's per-step log lines (their timestamps, samples_consumed, wait_s,
step_s, tokens):
    samples/s   samples trained between the end of step --warmup and the last step, divided
                by the time between them (steady state: start-up and the first batches excluded)
    idle        time the trainer spent waiting for a batch (wait_s), over the same window
    sync idle   time the trainer spent in weight syncs (sync_idle_s) over the window
    idle/sync   the mean sync_idle_s of a sync (blocking: the whole sync; overlapped: waiting
                for the previous broadcast plus taking the snapshot), in seconds and as a share
                of a step (the window's wall time per step)
    trainer tok/s  tokens trained per second of the trainer's own compute (step_s): the same
                in every setting on a quiet machine; lower in async means the trainer's core was
                shared while the engine ran (the script says so)
    length bias  the response lengths of the samples trained (every group a step logged, its
                designated lengths) over those of every sample generated to its end or dropped
                as stale (the trained groups and the groups the rollouter's and the queue's
                logs name as dropped stale): mean and 90th percentile. Below 1: the bound
                dropped the long answers. Also against the sync setting's trained samples
                when it ran (the on-policy reference, whose every admitted group is trained).
Also printed: stale drops (samples generated and then dropped by the staleness bound, and their
share of the samples generated), mean response length, the largest batch staleness and the
largest age since admission.
"""

from __future__ import annotations

import os
import sys

import argparse
import json
import re
import shutil
import subprocess
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results import row, write  # noqa: E402
from rollmesh.runtime.cpus import parse_cpulist  # noqa: E402

PYTHON = ROOT / ".venv" / "bin" / "python"
LOOP_NAME = "bench_long_tail"

# The agent loop of this benchmark: single_turn with a per-sample length, resumable.
LOOP_MODULE = '''"""Written by benchmarks/e2e.py for one run: single_turn, per-sample budget."""


class LongTail:
    name = "bench_long_tail"

    def __init__(self, ctx):
        self.ctx = ctx

    async def run(self, traj):
        target = int(traj.metadata["bench_lengths"][traj.index])
        remaining = target - (len(traj.token_ids) - traj.prompt_len)
        if remaining > 0:
            await self.ctx.generate(traj, remaining)  # raises Interrupted on a sync: resumed
        traj.num_turns = 1
        traj.status = "finished"
'''

def parse_cpus(text: str) -> tuple[int, ...] | None:
    """'0', '0,1', '0-3' -> the CPUs; '' -> None (unpinned)."""
    return parse_cpulist(text) if text.strip() else None


def draw_lengths(rows: int, group_size: int, median: float, sigma: float, lo: int, hi: int,
                 seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(np.log(median), sigma, size=(rows, group_size))
    return np.clip(np.round(raw), lo, hi).astype(int)


def write_package(directory: Path) -> None:
    """A module and a .dist-info whose entry point registers the loop (found via PYTHONPATH)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "rollmesh_bench_e2e.py").write_text(LOOP_MODULE)
    info = directory / "rollmesh_bench_e2e-0.0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rollmesh-bench-e2e\n"
                                   "Version: 0.0.0\n")
    (info / "entry_points.txt").write_text(
        f"[rollmesh.agent_loops]\n{LOOP_NAME} = rollmesh_bench_e2e:LongTail\n")


def write_dataset(path: Path, lengths: np.ndarray) -> None:
    prompts = [json.loads(line) for line in
               (ROOT / "configs/data/letters_train.jsonl").read_text().splitlines() if line]
    with open(path, "w") as f:
        for i, lens in enumerate(lengths):
            src = prompts[i % len(prompts)]
            f.write(json.dumps({"prompt": src["prompt"], "label": src["label"],
                                "agent_loop": LOOP_NAME, "bench_lengths": lens.tolist(),
                                "sampling": {"ignore_eos": True}}) + "\n")


def write_cluster(path: Path, work: Path, args: argparse.Namespace, port_base: int) -> None:
    """Every role on this machine, each with its CPUs (rollmesh's `cpus`; '' leaves it out)."""
    cpus = {"engine": args.engine_cpus, "trainer": args.trainer_cpus}
    lines = ['name = "bench-e2e"', f'experiment = "{ROOT / "configs/tiny_cpu.toml"}"',
             f'run_dir = "{work}"']
    if args.other_cpus.strip():
        lines.append(f'launcher_cpus = "{args.other_cpus}"')
    lines += ["", "[hosts.local]", 'address = "127.0.0.1"', f'python = "{PYTHON}"',
              f'workdir = "{ROOT}"', ""]
    counts = {"agent_worker": 2}
    for role in ("engine", "trainer", "rollouter", "agent_worker", "reward_worker",
                 "message_queue", "synchronizer"):
        lines += [f"[roles.{role}]", 'host = "local"', f"count = {counts.get(role, 1)}"]
        text = cpus.get(role, args.other_cpus)
        if text.strip():
            lines.append(f'cpus = "{text}"')
        lines.append("")
    lines += ["[ports]", f"base = {port_base}", ""]
    path.write_text("\n".join(lines))


def _ts(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def affinity_of(pid: int) -> str:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


GROUP_ROW = re.compile(r"^e\d+-r(\d+)-")


def row_of(group_id: str) -> int:
    """The dataset row of a group id (`e<epoch>-r<row>-...`, rollmesh.rollout.data)."""
    m = GROUP_ROW.match(group_id)
    if m is None:
        raise RuntimeError(f"group id {group_id!r} does not name its row")
    return int(m.group(1))


def stale_dropped_groups(logs: Path) -> list[str]:
    """The groups every role's log names as dropped stale (rollouter: one `group_dropped_stale`
    line each; MessageQueue: `groups_dropped_stale` with the list)."""
    out: list[str] = []
    for path in sorted(logs.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if "dropped_stale" not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == "group_dropped_stale":
                out.append(rec["group"])
            elif rec.get("event") == "groups_dropped_stale":
                out.extend(rec["groups"])
    return out


def lengths_of(groups: list[str], lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([lengths[row_of(g)] for g in groups]) if groups else np.zeros(0)


def bias(trained: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """(mean ratio, p90 ratio) of trained response lengths over the reference's."""
    if not len(trained) or not len(reference):
        return float("nan"), float("nan")
    return (float(trained.mean() / reference.mean()),
            float(np.percentile(trained, 90) / np.percentile(reference, 90)))


def run_setting(name: str, args: argparse.Namespace, work: Path, pkg: Path,
                dataset: Path, port_base: int, overlap: bool = False,
                lengths: np.ndarray | None = None) -> dict:
    """One launch; `name` is "sync" or "<max_staleness>/<measure>"."""
    staleness, _, measure = name.partition("/")
    tag = (f"{name}-overlap" if overlap else name).replace("/", "-")
    run_dir = work / f"run-{tag}"
    cluster = work / f"cluster-{tag}.toml"
    write_cluster(cluster, work, args, port_base)
    sets = {
        "data.train_path": str(dataset), "data.group_size": args.group_size,
        "data.default_agent_loop": LOOP_NAME, "data.max_prompt_tokens": 64,
        "model.max_context": args.max_len + 80,
        "rollout.max_new_tokens": args.max_len, "rollout.batch_groups": args.batch_groups,
        "rollout.max_concurrent": args.max_concurrent, "rollout.eval_every": 0,
        "engine.max_running_requests": args.engine_batch,
        "trainer.total_steps": args.steps, "trainer.checkpoint_every": 0,
        "staleness.sync_mode": "true" if name == "sync" else "false",
        "staleness.max_staleness": 0 if name == "sync" else int(staleness),
        **({"staleness.measure": measure} if measure else {}),
        "sync.overlap": "true" if overlap else "false",
    }
    cmd = [str(PYTHON), "-m", "rollmesh", "launch", str(cluster), "--quiet",
           "--run-dir", str(run_dir)]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pkg), str(ROOT)]))
    started = time.monotonic()
    log = open(work / f"launcher-{tag}.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    placement: dict[str, str] = {}
    try:
        while proc.poll() is None:
            if time.monotonic() - started > args.timeout:
                proc.terminate()
                proc.wait(60)
                raise RuntimeError(f"setting {name}: no result within {args.timeout:g}s "
                                   f"(launcher log: {log.name})")
            status = run_dir / "status.json"
            if status.exists() and len(placement) < 9:
                placement["launcher"] = affinity_of(proc.pid)  # launcher_cpus
                try:
                    for p in json.loads(status.read_text())["processes"]:
                        if p.get("pid") and p["state"] != "exited":
                            placement[p["name"]] = affinity_of(p["pid"])
                except (ValueError, KeyError):
                    pass
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    wall = time.monotonic() - started
    if proc.returncode != 0:
        tail = Path(log.name).read_text()[-3000:]
        raise RuntimeError(f"setting {name}: launcher exited {proc.returncode}\n{tail}")
    steps = [json.loads(line) for line in (run_dir / "logs/trainer-0.log").read_text().splitlines()
             if '"event": "step"' in line]
    steps = [s for s in steps if s.get("event") == "step"]
    if len(steps) <= args.warmup + 1:
        raise RuntimeError(f"setting {name}: only {len(steps)} steps logged")
    window = steps[max(args.warmup - 1, 0):]  # from the end of step --warmup
    t0, t1 = _ts(window[0]["timestamp"]), _ts(window[-1]["timestamp"])
    span = t1 - t0
    samples = window[-1]["samples_consumed"] - window[0]["samples_consumed"]
    wait = sum(s["wait_s"] for s in window[1:])
    compute = sum(s["step_s"] for s in window[1:])
    trained_tokens = sum(s["tokens"] for s in window[1:])
    sync = sum(s.get("sync_idle_s", 0.0) for s in window[1:])
    syncs = [s["sync_idle_s"] for s in window[1:] if "sync_idle_s" in s]
    step_wall = span / max(len(window) - 1, 1)
    summary = json.loads((run_dir / "summary.json").read_text())
    trained_groups = [g for st in steps for g in st.get("group_ids", ())]
    dropped_groups = stale_dropped_groups(run_dir / "logs")
    trained = lengths_of(trained_groups, lengths) if lengths is not None else np.zeros(0)
    generated = (np.concatenate([trained, lengths_of(dropped_groups, lengths)])
                 if lengths is not None else np.zeros(0))
    stale = int((summary.get("dropped") or {}).get("stale", 0))
    result = {
        "setting": name, "samples_per_s": samples / span, "idle": wait / span,
        "sync_idle": sync / span, "trainer_tok_s": trained_tokens / compute, "span_s": span,
        "idle_per_sync_s": float(np.mean(syncs)) if syncs else 0.0,
        "idle_per_sync_of_step": (float(np.mean(syncs)) if syncs else 0.0) / step_wall,
        "step_wall_s": step_wall, "overlap": overlap,
        "samples": samples, "wall_s": wall,
        "steps": len(steps), "consumed": steps[-1]["samples_consumed"],
        "response_tokens_mean": float(np.mean([s["response_tokens_mean"] for s in steps])),
        "staleness_max": max(s["batch_staleness_max"] for s in steps),
        "admission_age_max": max(s.get("batch_admission_age_max", float("nan")) for s in steps),
        "trained_lengths": trained, "generated_lengths": generated,
        "length_bias": bias(trained, generated), "stale_dropped": stale,
        "stale_frac": stale / max(len(generated), 1),
        "dropped": summary.get("dropped", {}), "admitted": summary.get("admitted"),
        "placement": placement, "run_dir": str(run_dir),
    }
    return result


def label_of(setting: str, overlap: bool) -> str:
    staleness, _, measure = setting.partition("/")
    label = ("sync (max_staleness 0)" if setting == "sync"
             else f"async (max_staleness {staleness}, {measure})")
    return label + (", overlapped syncs" if overlap else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="sync,1,2",
                   help="comma-separated: sync and/or max_staleness values")
    p.add_argument("--measures", default="admission",
                   help="comma-separated staleness.measure rules for every async setting: "
                        "admission and/or oldest_token")
    p.add_argument("--overlap", choices=["off", "on", "both"], default="off",
                   help="weight syncs: blocking (off), overlapped with training (on: "
                        "sync.overlap = true), or every setting both ways, side by side")
    p.add_argument("--steps", type=int, default=24, help="trainer steps per setting")
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the steady state")
    p.add_argument("--batch-groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-concurrent", type=int, default=16, help="rollout.max_concurrent")
    p.add_argument("--engine-batch", type=int, default=64, help="engine.max_running_requests")
    p.add_argument("--median-len", type=float, default=32)
    p.add_argument("--sigma", type=float, default=1.3, help="lognormal shape of the lengths")
    p.add_argument("--min-len", type=int, default=4)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--rows", type=int, default=64, help="dataset rows (prompts)")
    p.add_argument("--seed", type=int, default=0, help="seed of the response lengths")
    p.add_argument("--engine-cpus", default="0")
    p.add_argument("--trainer-cpus", default="1")
    p.add_argument("--other-cpus", default="engine",
                   help="light roles and the launcher: 'engine' (the engine's cpus: the rollout "
                        "side, as the rollouter and workers sit on the rollout hosts), a cpu "
                        "list, or '' (unpinned)")
    p.add_argument("--port-base", type=int, default=29300)
    p.add_argument("--timeout", type=float, default=600, help="seconds per setting, at most")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    p.add_argument("--json", help="write result rows (benchmarks/results.py) here")
    args = p.parse_args()
    if args.other_cpus == "engine":
        args.other_cpus = args.engine_cpus
    for flag in ("engine_cpus", "trainer_cpus", "other_cpus"):
        try:
            parse_cpus(getattr(args, flag))
        except ValueError as e:
            p.error(f"--{flag.replace('_', '-')}: {e}")
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    for s in settings:
        if s != "sync" and not s.isdigit():
            p.error(f"--settings: {s!r} is neither 'sync' nor a max_staleness")
    measures = [m.strip() for m in args.measures.split(",") if m.strip()]
    for m in measures:
        if m not in ("admission", "oldest_token"):
            p.error(f"--measures: {m!r} is neither 'admission' nor 'oldest_token'")
    settings = [x for s in settings for x in ([s] if s == "sync" else
                                              [f"{s}/{m}" for m in measures])]

    work = Path(tempfile.mkdtemp(prefix="rollmesh-e2e-"))
    pkg = work / "pkg"
    write_package(pkg)
    lengths = draw_lengths(args.rows, args.group_size, args.median_len, args.sigma,
                           args.min_len, args.max_len, args.seed)
    dataset = work / "data.jsonl"
    write_dataset(dataset, lengths)
    flat = lengths.ravel()
    batch = args.batch_groups * args.group_size
    print(f"e2e: tiny model, built-in engine, {args.steps} steps x {batch} samples per setting "
          f"(steady state after step {args.warmup}); engine cpus {args.engine_cpus or 'any'}, "
          f"trainer cpus {args.trainer_cpus or 'any'}, other roles {args.other_cpus or 'any'}; "
          f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f} (other processes on "
          f"the cores skew every figure)")
    print(f"response lengths: lognormal median {args.median_len:g} sigma {args.sigma:g}, "
          f"clipped [{args.min_len}, {args.max_len}]: mean {flat.mean():.0f}, p50 "
          f"{np.median(flat):.0f}, p90 {np.percentile(flat, 90):.0f}, p99 "
          f"{np.percentile(flat, 99):.0f}, max {flat.max()}; work dir {work}")

    modes = {"off": [False], "on": [True], "both": [False, True]}[args.overlap]
    results: dict[tuple[str, bool], dict] = {}
    try:
        for i, (s, overlap) in enumerate((s, o) for s in settings for o in modes):
            r = run_setting(s, args, work, pkg, dataset, args.port_base + 100 * i, overlap,
                            lengths)
            results[(s, overlap)] = r
            print(f"  {label_of(s, overlap):36s} {r['samples_per_s']:7.2f} samples/s  idle "
                  f"{r['idle']:6.1%}  sync idle {r['sync_idle']:6.1%} ("
                  f"{r['idle_per_sync_s']:.3f}s a sync, {r['idle_per_sync_of_step']:.1%} of a "
                  f"step)  trainer {r['trainer_tok_s']:6.0f} tok/s  ({r['samples']} samples in "
                  f"{r['span_s']:.1f}s steady, run {r['wall_s']:.0f}s; mean response "
                  f"{r['response_tokens_mean']:.0f} tok; staleness max "
                  f"{r['staleness_max']:g}, since admission {r['admission_age_max']:g}; "
                  f"dropped {r['dropped'] or 0})", flush=True)
            print("    affinity: " + ", ".join(f"{k}={v}" for k, v in
                                               sorted(r["placement"].items())), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    rows = []
    print(f"\n{'setting':36s} {'samples/s':>10s} {'vs sync':>8s} {'idle':>7s} {'sync idle':>9s} "
          f"{'idle/sync':>10s} {'of a step':>9s} {'trainer tok/s':>13s}")
    for (s, overlap), r in results.items():
        base = results.get(("sync", overlap))
        ratio = f"{r['samples_per_s'] / base['samples_per_s']:.2f}x" if base else "-"
        print(f"{label_of(s, overlap):36s} {r['samples_per_s']:10.2f} {ratio:>8s} "
              f"{r['idle']:7.1%} {r['sync_idle']:9.1%} {r['idle_per_sync_s']:9.3f}s "
              f"{r['idle_per_sync_of_step']:9.1%} {r['trainer_tok_s']:13.0f}")
    print(f"\nlength bias (response lengths of the trained samples / of every sample generated "
          f"or dropped as stale; 'vs sync': / the sync setting's trained samples):\n"
          f"{'setting':44s} {'stale drops':>14s} {'trained mean/p90':>17s} "
          f"{'generated':>12s} {'ratio mean':>10s} {'p90':>6s} {'vs sync':>13s}")
    for (s, overlap), r in results.items():
        t, g = r["trained_lengths"], r["generated_lengths"]
        base = results.get(("sync", overlap))
        vs = bias(t, base["trained_lengths"]) if base else (float("nan"),) * 2
        print(f"{label_of(s, overlap):44s} {r['stale_dropped']:6d} ({r['stale_frac']:5.1%}) "
              f"{t.mean() if len(t) else 0:8.0f}/{np.percentile(t, 90) if len(t) else 0:<8.0f} "
              f"{g.mean() if len(g) else 0:5.0f}/{np.percentile(g, 90) if len(g) else 0:<6.0f} "
              f"{r['length_bias'][0]:10.2f} {r['length_bias'][1]:6.2f} "
              f"{vs[0]:6.2f}/{vs[1]:<6.2f}")
    if len(modes) == 2:
        print(f"\noverlapped vs blocking syncs (same setting, same run):\n"
              f"{'setting':26s} {'samples/s':>20s} {'ratio':>6s} {'idle per sync':>22s} "
              f"{'of a step':>16s}")
        for s in settings:
            b, o = results[(s, False)], results[(s, True)]
            print(f"{label_of(s, False)[:26]:26s} {b['samples_per_s']:9.2f} -> "
                  f"{o['samples_per_s']:7.2f} {o['samples_per_s'] / b['samples_per_s']:5.2f}x "
                  f"{b['idle_per_sync_s']:9.3f}s -> {o['idle_per_sync_s']:7.3f}s "
                  f"{b['idle_per_sync_of_step']:6.1%} -> {o['idle_per_sync_of_step']:6.1%}")
    first = modes[0]  # the async vs sync comparisons: blocking syncs unless only overlapped
    suffix = ", overlapped syncs" if first else ""
    base = results.get(("sync", first))
    if base and any(r["trainer_tok_s"] < 0.85 * base["trainer_tok_s"]
                    for (k, o), r in results.items() if k != "sync" and o == first):
        print("note: the trainer computed >15% slower while the engine ran beside it than in "
              "sync mode: its core was shared (other processes on the machine, or the cores "
              "are siblings); the async figures are then pessimistic")
    common = (f"tiny model, built-in engine (cpus {args.engine_cpus or 'any'}), trainer (cpus "
              f"{args.trainer_cpus or 'any'}), lognormal lengths median {args.median_len:g} "
              f"sigma {args.sigma:g} max {args.max_len}, {args.steps} steps x {batch} samples")
    for (s, overlap), r in results.items():
        if s == "sync" or base is None or overlap != first:
            continue
        rows.append(row(f"e2e samples/s, {label_of(s, False)} vs sync{suffix}",
                        r["samples_per_s"], base["samples_per_s"], "samples/s",
                        baseline_name="sync mode", higher_is_better=True, target=1.6,
                        note=common))
    for (s, overlap), r in results.items():
        if overlap != first:
            continue
        label = label_of(s, False)
        for i, stat in enumerate(("mean", "p90")):
            rows.append(row(f"e2e length bias ({stat} response trained / generated), {label}"
                            f"{suffix}", r["length_bias"][i], 1.0, "ratio",
                            baseline_name="unbiased (1.0)", higher_is_better=True, target=0.95,
                            note=f"stale drops {r['stale_dropped']} ({r['stale_frac']:.1%} of "
                                 f"the samples generated); " + common))
    for (s, overlap), r in results.items():
        if overlap != first:
            continue
        label = label_of(s, False)
        rows.append(row(f"e2e trainer idle fraction, {label}{suffix}", r["idle"],
                        base["idle"] if base else float("nan"), "fraction of wall",
                        baseline_name="sync mode", higher_is_better=False,
                        note="time waiting for a batch / steady-state wall; " + common))
    if len(modes) == 2:
        for s in settings:
            b, o = results[(s, False)], results[(s, True)]
            label = "sync mode" if s == "sync" else f"max_staleness {s}"
            rows.append(row(f"e2e samples/s, overlapped vs blocking syncs ({label})",
                            o["samples_per_s"], b["samples_per_s"], "samples/s",
                            baseline_name="blocking syncs", higher_is_better=True, note=common))
            rows.append(row(f"e2e trainer idle per sync / step, overlapped vs blocking ({label})",
                            o["idle_per_sync_of_step"], b["idle_per_sync_of_step"],
                            "fraction of a step", baseline_name="blocking syncs",
                            higher_is_better=False,
                            note="mean sync_idle_s / steady-state wall per step (goal: < 5%); "
                                 + common))
    write(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
