"""Run every benchmark and write benchmarks/RESULTS.md: figure, rollmesh, baseline, ratio, command.

    .venv/bin/python benchmarks/run_all.py [--only e2e,queue,...] [--out benchmarks/RESULTS.md]
    .venv/bin/python benchmarks/run_all.py --from-json DIR [--only ...]

Each benchmark is its own script (see benchmarks/README.md), run here as a subprocess with
`--json`; every comparison in it is measured side by side in that one run. A benchmark that
fails is reported in the file with its exit code and the tail of its output, and the others go
on.

--from-json DIR runs nothing: it renders the table from files the scripts already wrote,
DIR/NAME.json for NAME in the list below (e2e.json, mq_durable.json, ...: each script run alone
with `--json DIR/NAME.json` and any arguments). Those rows replace the rows of the same benchmark
in the existing RESULTS.md; the rows of every other benchmark are kept as they are, with their
notes, and a `measured` column gives each row its run: the date and, where DIR/NAME.meta.json
says it (`{"started": "...", "minutes": 4.2, "load": "1.2 before, 1.6 after", "command": "..."}`),
the time it took and the load average (else the date is the JSON file's modification time).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> the arguments of benchmarks/<script> (sizes chosen to run in minutes on 2 cores)
BENCHMARKS: dict[str, list[str]] = {
    "e2e": ["benchmarks/e2e.py"],
    "mq": ["benchmarks/mq.py"],
    # as `rollmesh launch` runs it: every put and hand-out in the queue's log first
    "mq_durable": ["benchmarks/mq.py", "--durable"],
    "weight_sync": ["benchmarks/weight_sync.py"],
    "partial_rollout": ["benchmarks/partial_rollout.py"],
    "engine": ["benchmarks/engine.py"],
    "wire": ["benchmarks/wire.py"],
    "simulate": ["benchmarks/simulate.py"],
    # one trainer step at Qwen2.5-0.5B's shape against a plain transformers step (~6 min)
    "train_step": ["benchmarks/train_step.py", "--device", "cpu", "--shape", "0.5b",
                   "--repeats", "2"],
}


KEPT = "<!-- kept by run_all.py: the sections below are written by benchmarks run alone -->"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kib / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    try:
        import torch
        gpu = (f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available()
               else ", no GPU")
        tv = f", torch {torch.__version__}"
    except ImportError:
        gpu, tv = "", ""
    return (f"{cpu}, {os.cpu_count()} cores{mem}{gpu}; Python {platform.python_version()}{tv}; "
            f"{platform.system()} {platform.release()}")


def fmt(x: float | None) -> str:
    if x is None or x != x:
        return "-"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def verdict(r: dict) -> str:
    if r.get("target") is None:
        return ""
    sign = ">=" if r["higher_is_better"] else "<="
    return f"{'met' if r['met'] else 'MISSED'} ({sign} {r['target']:g}x)"


def render(results: dict[str, dict], started: str, took_s: float) -> str:
    out = ["# rollmesh benchmark results", "",
           f"Machine: {machine()}.", f"Run: {started}, {took_s / 60:.1f} min, "
           "`.venv/bin/python benchmarks/run_all.py`.", "",
           "Ratio: rollmesh / baseline (for costs such as seconds, lower is better and a target "
           "is a ceiling). Every row's two figures come from one run of its command.", "",
           "| figure | rollmesh | baseline | ratio | target | command |",
           "|---|---|---|---|---|---|"]
    notes = []
    for name, res in results.items():
        if res["rows"] is None:
            out.append(f"| {name}: did not run (exit {res['code']}) | - | - | - | - | "
                       f"`{res['command']}` |")
            notes.append(f"- **{name}** exited with {res['code']}:\n\n```\n{res['tail']}\n```")
            continue
        for r in res["rows"]:
            out.append(f"| {r['figure']} | {fmt(r['rollmesh'])} {r['unit']} | "
                       f"{fmt(r['baseline'])} {r['unit']} ({r['baseline_name']}) | "
                       f"{fmt(r['ratio'])}x | {verdict(r)} | `{r['command']}` |")
            if r.get("note"):
                notes.append(f"- {r['figure']}: {r['note']}")
    if notes:
        out += ["", "## Notes", "", *notes]
    return "\n".join(out) + "\n"


def bench_name(command: str) -> str | None:
    """The BENCHMARKS entry a row's command belongs to (`.venv/bin/python benchmarks/mq.py
    --durable` -> mq_durable): same script, and the most of the entry's own flags present."""
    args = command.strip().strip("`").split()
    args = args[1:] if args and args[0].endswith("python") else args
    if not args:
        return None
    best = None
    for name, spec in BENCHMARKS.items():
        if spec[0] == args[0] and all(x in args[1:] for x in spec[1:]):
            if best is None or len(spec) > len(BENCHMARKS[best]):
                best = name
    return best


def pasteable(command: str) -> str:
    """A script's own argv (`benchmarks/e2e.py ... --json /tmp/x.json`) as a reader pastes it."""
    args = command.split()
    if "--json" in args:  # the output file is not part of what was measured
        i = args.index("--json")
        del args[i:i + 2]
    if args and args[0].startswith("benchmarks/"):
        args.insert(0, ".venv/bin/python")
    return " ".join(args)


def previous_table(text: str) -> tuple[list[tuple[str, str]], dict[str, str], str | None]:
    """The rows of an existing RESULTS.md's top table, as (benchmark name, markdown line) with
    a `measured` cell, its notes by figure, and its run line (the date of rows without one)."""
    lines = text[:text.index(KEPT)].splitlines() if KEPT in text else text.splitlines()
    run = next((ln for ln in lines if ln.startswith("Run: ")), None)
    mark = "; the last run_all.py run: "  # kept by a table this option rendered before
    rendered = next((ln for ln in lines if mark in ln), None)
    if run is None and rendered:
        run = "Run: " + rendered.split(mark, 1)[1].rsplit(").", 1)[0]
    when = run[len("Run: "):].split(",")[0] if run else "date unknown"
    header = next((i for i, ln in enumerate(lines) if ln.startswith("| figure |")), None)
    rows, notes = [], {}
    if header is not None:
        has_measured = "| measured |" in lines[header]
        for ln in lines[header + 2:]:
            if not ln.startswith("|"):
                break
            cells = [c.strip() for c in ln.strip().strip("|").split("|")]
            name = bench_name(cells[5]) if len(cells) > 5 else None
            if not has_measured:
                ln = ln.rstrip() + f" {when} (`run_all.py`) |"
            rows.append((name or cells[0], ln))
    figures = [ln.strip().strip("|").split("|")[0].strip() for _, ln in rows]
    for ln in lines:  # "- FIGURE: NOTE" (a figure may itself hold ": ")
        for figure in figures:
            if ln.startswith(f"- {figure}: "):
                notes.setdefault(figure, ln[len(f"- {figure}: "):])
    return rows, notes, run


def render_from_json(names: list[str], src: Path, previous: str) -> str:
    old_rows, old_notes, old_run = previous_table(previous)
    fresh: dict[str, tuple[list[dict], str]] = {}
    for name in names:
        path = src / f"{name}.json"
        if not path.exists():
            continue
        rows = json.loads(path.read_text())
        meta_path = src / f"{name}.meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        when = meta.get("started") or time.strftime(
            "%Y-%m-%d %H:%M UTC", time.gmtime(path.stat().st_mtime))
        if meta.get("minutes") is not None:
            when += f", {float(meta['minutes']):.1f} min"
        if meta.get("load"):
            when += f", load average {meta['load']}"
        for r in rows:
            r["command"] = pasteable(meta.get("command") or r.get("command", ""))
        fresh[name] = (rows, when)
        print(f"{name}: {len(rows)} rows from {path} ({when})")
    if not fresh:
        raise SystemExit(f"no NAME.json in {src} for any of: {', '.join(names)}")
    out = ["# rollmesh benchmark results", "",
           f"Machine: {machine()}.",
           "Rows from separate runs, each named by its command and dated in `measured` "
           "(rendered by `.venv/bin/python benchmarks/run_all.py --from-json DIR` from the "
           "scripts' --json files; rows of benchmarks not run again are kept as they were"
           + (f"; the last run_all.py run: {old_run[len('Run: '):].rstrip('.')}" if old_run else "")
           + ").", "",
           "Ratio: rollmesh / baseline (for costs such as seconds, lower is better and a target "
           "is a ceiling). Every row's two figures come from one run of its command.", "",
           "| figure | rollmesh | baseline | ratio | target | command | measured |",
           "|---|---|---|---|---|---|---|"]
    notes: list[str] = []
    noted: set[str] = set()
    order = list(BENCHMARKS) + [n for n, _ in old_rows if n not in BENCHMARKS]
    for name in dict.fromkeys(order):
        if name in fresh:
            rows, when = fresh[name]
            for r in rows:
                out.append(f"| {r['figure']} | {fmt(r['rollmesh'])} {r['unit']} | "
                           f"{fmt(r['baseline'])} {r['unit']} ({r['baseline_name']}) | "
                           f"{fmt(r['ratio'])}x | {verdict(r)} | `{r['command']}` | {when} |")
                if r.get("note"):
                    notes.append(f"- {r['figure']}: {r['note']}")
            continue
        for n, ln in old_rows:
            if n == name:
                out.append(ln)
                figure = ln.strip().strip("|").split("|")[0].strip()
                if figure in old_notes and figure not in noted:
                    notes.append(f"- {figure}: {old_notes[figure]}")
                    noted.add(figure)
    if notes:
        out += ["", "## Notes", "", *notes]
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    p.add_argument("--out", default=str(ROOT / "benchmarks/RESULTS.md"))
    p.add_argument("--timeout", type=float, default=1800, help="seconds per benchmark")
    p.add_argument("--from-json", metavar="DIR", help="run nothing: render the table from "
                   "DIR/NAME.json files the scripts wrote (--json), keeping the existing rows "
                   "of the benchmarks without one")
    a = p.parse_args()
    names = a.only.split(",") if a.only else list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHMARKS)}")
    if a.from_json:
        out = Path(a.out)
        previous = out.read_text() if out.exists() else ""
        kept = previous[previous.index(KEPT):] if KEPT in previous else ""
        table = render_from_json(names, Path(a.from_json), previous)
        out.write_text(table.rstrip("\n") + "\n\n" + kept)
        print(f"wrote {a.out}")
        return 0
    started, t0 = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time.monotonic()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            args = list(BENCHMARKS[name])
            # the queue's capacity as measured just now (durable, as `rollmesh launch` runs it)
            measured = [r for k in ("mq_durable", "mq") for r in results.get(k, {}).get("rows")
                        or [] if "vs Ray" in r["figure"]]
            capacity = measured[0]["rollmesh"] if measured else None
            if name == "simulate" and capacity:
                args += ["--mq-capacity", f"{capacity:.0f}"]
            command = ".venv/bin/python " + " ".join(args)
            path = Path(tmp) / f"{name}.json"
            print(f"== {name}: {command}", flush=True)
            try:
                proc = subprocess.run([sys.executable, *args, "--json", str(path)], cwd=ROOT,
                                      capture_output=True, text=True, timeout=a.timeout)
                code, output = proc.returncode, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as e:
                code = "timeout"
                output = (e.stdout or b"").decode(errors="replace") if isinstance(
                    e.stdout, bytes) else (e.stdout or "")
            print(output[-4000:], flush=True)
            rows = json.loads(path.read_text()) if code == 0 and path.exists() else None
            for r in rows or []:  # the command a reader can paste, not the temporary --json
                r["command"] = command
            results[name] = {"rows": rows, "code": code, "command": command,
                             "tail": "\n".join(output.strip().splitlines()[-15:])}
    out = Path(a.out)
    # Sections of benchmarks run alone (real_scale.py, gpu.py, ...) sit below KEPT: kept as
    # they are, not dropped with the table this run replaces.
    previous = out.read_text() if out.exists() else ""
    kept = previous[previous.index(KEPT):] if KEPT in previous else ""
    out.write_text(render(results, started, time.monotonic() - t0).rstrip("\n") + "\n\n" + kept)
    print(f"wrote {a.out}")
    return 0 if all(r["rows"] is not None for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
