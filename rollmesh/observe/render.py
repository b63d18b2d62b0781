"""The monitor's dashboard: a snapshot (plain data, `monitor.StatusBoard.snapshot()`) drawn as
rich panels (`render`), and the reward sparkline."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

BLOCKS = "▁▂▃▄▅▆▇█"


def _num(v: Any) -> float | int | None:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def sparkline(values: list[Any], width: int = 48) -> str:
    vals = [v for v in values if _num(v) is not None and math.isfinite(v)][-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    if hi == lo:
        return BLOCKS[3] * len(vals)
    return "".join(BLOCKS[round((v - lo) / (hi - lo) * (len(BLOCKS) - 1))] for v in vals)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.0f}" if math.isfinite(v) and abs(v) >= 1000 else f"{v:.4g}"
    return str(v)


def _clock(seconds: Any) -> str:
    if _num(seconds) is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _fields(pairs: list[tuple[str, Any]]) -> Table:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    for label, value in pairs:
        t.add_row(label, value if isinstance(value, Text) else _fmt(value))
    return t


def _header(snap: dict[str, Any], live: bool) -> Text:
    state = snap.get("state") or "waiting for status"
    style = {"running": "green", "finished": "blue", "failed": "red"}.get(state, "yellow")
    header = Text.assemble(("rollmesh monitor  ", "bold"), f"run {snap.get('run') or '-'}  ",
                           ("state ", "bold"), (state, style),
                           f"  elapsed {_clock(snap.get('elapsed_s'))}  "
                           f"hub {snap.get('hub') or '-'}")
    launcher = snap.get("launcher") or {}
    if launcher.get("last_seen_s") is not None and not launcher.get("alive"):
        header.append(f"  launcher silent {launcher['last_seen_s']:.0f}s", "red")
    admission = str((snap.get("rollouter") or {}).get("admission") or "")
    if admission.startswith("stopped"):  # an engine outage: say it where it is seen first
        header.append(f"  admission {admission}", "bold red")
    unreachable = (snap.get("rollouter") or {}).get("queue_unreachable_s")
    if unreachable is not None:  # a partition between the rollouter and the MessageQueue
        header.append(f"  MessageQueue unreachable from the rollouter for {unreachable:g}s",
                      "bold red")
    # a durable log that cannot be written (a full disk): the path and the error
    for who, error in (("queue log", (snap.get("queue") or {}).get("log_error")),
                       ("rollouter journal", (snap.get("rollouter") or {}).get("journal_error"))):
        if error:
            header.append(f"  {who}: {error}", "bold red")
    if live:
        header.append("   (q or Ctrl-C detaches)", "dim")
    if snap.get("failure"):
        header.append(f"\n{snap['failure']}", "red")
    return header


def _roles_panel(snap: dict[str, Any]) -> Panel:
    table = Table(expand=True, box=None)
    for col in ("process", "host", "pid", "state", "liveness", "restarts", "bad"):
        table.add_column(col, style="bold" if col == "process" else None,
                         no_wrap=col == "process", min_width=16 if col == "process" else None)
    for r in snap.get("roles") or []:
        seen = r.get("last_seen_s")
        liveness = Text(r["liveness"] + ("" if seen is None else f" {seen:.0f}s"),
                        "green" if r["alive"] else "red")
        restarts = r.get("restarts") or 0
        bad = r.get("protocol_errors")
        table.add_row(r["name"], _fmt(r.get("host")), _fmt(r.get("pid")), _fmt(r.get("state")),
                      liveness, Text(str(restarts), "yellow" if restarts else ""),
                      Text(_fmt(bad), "red" if bad else ""))
    return Panel(table, title="Roles")


def _engines_panel(snap: dict[str, Any]) -> Panel:
    table = Table(expand=True, box=None)
    table.add_column("engine", no_wrap=True)
    for col in ("healthy", "running", "waiting", "load", "version", "cache"):
        table.add_column(col)
    for e in snap.get("engines") or []:
        hit = e.get("prefix_cache_hit_rate")  # of the prompt tokens sent, found cached
        table.add_row(str(e["url"] or "-").removeprefix("http://"),
                      Text(_fmt(e["healthy"]), "green" if e["healthy"] else "red"),
                      _fmt(e["running_requests"]), _fmt(e["waiting_requests"]),
                      "█" * min(int(e["load"]), 10) + f" {e['load']}", _fmt(e["weight_version"]),
                      "-" if hit is None else f"{hit:.0%}")
    return Panel(table, title="Engines")


def _workers_panel(snap: dict[str, Any]) -> Panel:
    w = snap.get("workers") or {}
    a, r = w.get("agent") or {}, w.get("reward") or {}
    return Panel(_fields([
        ("agent workers", f"{a.get('count', 0)}, running {a.get('running', 0)} trajectories"),
        ("trajectories", f"finished {a.get('finished', 0)}  interrupted "
                         f"{a.get('interrupted', 0)}  failed {a.get('failed', 0)}"),
        ("generated tokens", a.get("generated_tokens", 0)),
        ("reward workers", r.get("count", 0)),
        ("rewards", f"ok {r.get('ok', 0)}  error {r.get('error', 0)}  "
                    f"timeout {r.get('timeout', 0)}"),
    ]), title="Workers")


def _sync_panel(snap: dict[str, Any]) -> Panel:
    s = snap.get("last_sync")
    if not s:
        return Panel(Text("no sync yet", "dim"), title="Last sync")
    failures = Text(_fmt(s.get("failures")), "red" if s.get("failures") else "")
    return Panel(_fields(
        [("version", s.get("version")), ("syncs", s.get("syncs")), ("failures", failures)]
        + [(k[:-2].replace("_", " ") + " s", s.get(k))
           for k in ("pause_s", "broadcast_s", "resume_s", "total_s", "trainer_idle_s")]),
        title="Last sync")


def _trainer_panel(snap: dict[str, Any]) -> Panel:
    tr = snap.get("trainer") or {}
    spark = Text(sparkline(tr.get("reward_history") or []), "cyan")
    optional = ("pg_loss", "clip_frac", "approx_kl", "entropy", "grad_norm", "lr",
                "samples_consumed")  # the eval: its own panel
    return Panel(_fields(
        ([("device phase", tr["phase"])] if tr.get("phase") else [])  # colocated mode
        + [("step", tr.get("step")), ("weight version", tr.get("version")),
         ("loss", tr.get("loss")), ("reward mean", tr.get("reward_mean")),
         ("reward history", spark), ("tokens/s", tr.get("tokens_per_s")),
         ("batch staleness max", tr.get("batch_staleness_max")),
         ("age since admission max", tr.get("batch_admission_age_max"))]
        + [(k.replace("_", " "), tr[k]) for k in optional if tr.get(k) is not None]),
        title="Trainer")


MAX_EVAL_SOURCES = 8  # data sources listed in the eval panel; the rest summed up in one line


def _share(v: Any) -> str:
    return f"{v:.3f}" if _num(v) is not None else "-"


def _eval_panel(snap: dict[str, Any]) -> Panel | None:
    ev = snap.get("eval")
    if not ev:
        return None
    pass_at = ev.get("pass_at") or {}
    size = (f"{_fmt(ev.get('n'))} answers, {_fmt(ev.get('prompts'))} prompts"
            if ev.get("n") is not None else "-")
    failed = ev.get("failed")
    rows: list[tuple[str, Any]] = [
        ("version", ev.get("version")), ("reward mean", _share(ev.get("reward_mean"))),
        ("pass@k", "  ".join(f"pass@{k} {_share(v)}" for k, v in pass_at.items()) or "-"),
        ("answers", Text(size + (f", {failed} failed" if failed else ""),
                         "yellow" if failed else ""))]
    sources = ev.get("by_source") or {}
    if not sources:
        return Panel(_fields(rows), title="Last eval")
    table = Table(box=None, padding=(0, 1))
    table.add_column("data source")
    for col in ("n", "reward", *(f"pass@{k}" for k in pass_at)):
        table.add_column(col, no_wrap=True, justify="right")
    for name, f in list(sources.items())[:MAX_EVAL_SOURCES]:
        table.add_row(name, _fmt(f.get("n")), _share(f.get("reward_mean")),
                      *(_share((f.get("pass_at") or {}).get(k)) for k in pass_at))
    if len(sources) > MAX_EVAL_SOURCES:
        table.add_row(Text(f"... {len(sources) - MAX_EVAL_SOURCES} more", "dim"))
    return Panel(Group(_fields(rows), table), title="Last eval")


def _shard_table(rows: list[dict[str, Any]], cols: tuple[str, ...]) -> Table:
    """A sharded role's instances, one line each: its figures and its own balance (`off`:
    0 when it balances; shown red when it does not, "-" until it reports its accounting)."""
    table = Table(box=None, padding=(0, 1))
    for col in ("shard", *cols, "balance"):
        table.add_column(col.replace("_", " "), no_wrap=True,
                         justify="left" if col == "shard" else "right")
    for row in rows:
        off = row.get("off")
        balance = (Text("-", "dim") if off is None else Text("ok", "green") if off == 0
                   else Text(f"off {off:+}", "bold red"))
        table.add_row(str(row.get("instance")), *(_fmt(row.get(c)) for c in cols), balance)
    return table


def _with_shards(panel_body: Any, snap: dict[str, Any], role: str,
                 cols: tuple[str, ...]) -> Any:
    """The panel's body, and under it the per-shard table when the run has several shards."""
    rows = (snap.get("shards") or {}).get(role) or []
    return Group(panel_body, _shard_table(rows, cols)) if rows else panel_body


def _rollouter_panel(snap: dict[str, Any]) -> Panel:
    ro = snap.get("rollouter") or {}
    return Panel(_with_shards(_fields([
        ("admitted", f"{_fmt(ro.get('admitted'))} samples "
                     f"({_fmt(ro.get('admitted_groups'))} groups)"),
        ("in flight", ro.get("in_flight")), ("cancel queue", ro.get("cancel_queue")),
        ("running groups", ro.get("running_groups")), ("capacity", ro.get("capacity")),
        ("version", ro.get("version")),
        ("paused", Text(_fmt(ro.get("paused")), "yellow" if ro.get("paused") else "")),
        ("admission", _admission(ro)),
    ]), snap, "rollouter", ("admitted", "in_flight", "queued", "dropped")), title="Rollouter")


def _admission(ro: dict[str, Any]) -> Text:
    """Whether new prompts are admitted; red while no engine is healthy (an outage: nothing
    new is admitted, generations in flight wait for an engine up to rollout.engine_wait_s)."""
    state = ro.get("admission")
    healthy, total = ro.get("engines_healthy"), ro.get("engines")
    engines = f" ({healthy}/{total} engines healthy)" if total else ""
    if state is None:
        return Text("-", "dim")
    if state.startswith("stopped"):
        since = ro.get("admission_stopped_s")
        return Text(f"{state}{engines}" + (f" for {since:g}s" if since is not None else ""),
                    "bold red")
    return Text(f"{state}{engines}", "yellow" if state != "open" else "green")


def _bars(hist: dict[str, int], colour: str) -> Table:
    most = max(hist.values(), default=0)
    bars = Table.grid(padding=(0, 1))
    for k, n in hist.items():
        bars.add_row(f"  {k}", Text("█" * max(1, round(24 * n / most)) if n else "", colour),
                     str(n))
    return bars


def _queue_panel(snap: dict[str, Any]) -> Panel:
    q = snap.get("queue") or {}
    measure = q.get("staleness_measure")
    reasons = {reason: n for reason, n in (q.get("dropped") or {}).items() if n}
    dropped = Table.grid(padding=(0, 1))
    for reason, n in reasons.items():
        dropped.add_row(f"  {reason}", str(n))
    return Panel(_with_shards(Group(_fields([
        ("depth", f"{_fmt(q.get('depth'))} samples ({_fmt(q.get('depth_groups'))} / "
                  f"{_fmt(q.get('capacity_groups'))} groups)"),
        ("consumed", f"{_fmt(q.get('consumed'))} ({_fmt(q.get('consumed_per_s'))}/s)"),
        ("max staleness", f"{_fmt(q.get('max_staleness'))}"
                          + (f" (bound at {measure})" if measure else "")),
        ("staleness", "(oldest token)"),
    ]), _bars(q.get("staleness_hist") or {}, "magenta"),
        _fields([("age", "(since admission)")]), _bars(q.get("admission_age_hist") or {}, "cyan"),
        _fields([("dropped", "" if reasons else "none")]), dropped),
        snap, "message_queue", ("depth", "put", "consumed", "dropped")), title="MessageQueue")


def _accounting_panel(snap: dict[str, Any]) -> Panel:
    acc = snap.get("accounting") or {}
    if acc.get("holds") is None:
        return Panel(Text("waiting for the rollouter and the MessageQueue", "dim"),
                     title="Accounting")
    text = Text(f"admitted {acc['admitted']} = consumed {acc['consumed']} + dropped "
                f"{acc['dropped_total']} + in flight {acc['in_flight']}  ",
                "green" if acc["holds"] else "yellow")
    if acc["holds"]:
        text.append("✓ holds")
    elif acc["rollouter_balances"] and acc["queue_balances"]:
        text.append(f"≈ off by {acc['difference']}: {acc['between']:+} samples between the "
                    "rollouter and the queue (each balances; their status was heard at "
                    "different moments)")
    else:
        sides = [name for name, ok in (("rollouter", acc["rollouter_balances"]),
                                       ("MessageQueue", acc["queue_balances"])) if not ok]
        text.append(f"✗ off by {acc['difference']}: the {' and the '.join(sides)} "
                    "does not balance")
        shards = snap.get("shards") or {}
        off = [f"{name} shard {row.get('instance')}"
               for role, name in (("rollouter", "rollouter"), ("message_queue", "MessageQueue"))
               for row in shards.get(role) or [] if row.get("off")]
        if off:  # which shard: each balances on its own or not
            text.append(f" ({', '.join(off)})")
    return Panel(text, title="Accounting")


def render(snap: dict[str, Any], *, width: int = 140, live: bool = False) -> Group:
    """The dashboard for one snapshot (drawn by Live, or printed once): two columns of panels
    from 120 columns of terminal up, one below."""
    left = Group(_roles_panel(snap), _engines_panel(snap), _workers_panel(snap),
                 _sync_panel(snap))
    right = Group(*(p for p in (_trainer_panel(snap), _eval_panel(snap), _rollouter_panel(snap),
                                _queue_panel(snap)) if p is not None))
    if width < 120:
        return Group(_header(snap, live), right, left, _accounting_panel(snap))
    body = Table.grid(expand=True, padding=(0, 1))
    body.add_column(ratio=1)
    body.add_column(ratio=1)
    body.add_row(left, right)
    return Group(_header(snap, live), body, _accounting_panel(snap))


# -- attaching to the hub --------------------------------------------------------------------------
