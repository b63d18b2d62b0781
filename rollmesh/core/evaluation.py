"""The figures of an evaluation round: mean reward and pass@k, overall and per data source.

Owns the arithmetic only (pure functions, no I/O): `pass_at_k` (the unbiased estimator of
Chen et al. 2021, "Evaluating Large Language Models Trained on Code"), `pass_ks` (which k an
eval of `eval_n` responses per prompt reports), `eval_summary` (a round's records -> the row
the rollouter logs and publishes as its `eval` stat) and `eval_metrics` (that row -> the flat
keys of a trainer metrics row).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["eval_metrics", "eval_summary", "pass_at_k", "pass_ks"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k responses drawn without replacement from n
    responses, c of which passed, passed: 1 - C(n - c, k) / C(n, k). Exact integer binomials,
    so large n loses nothing."""
    for name, value in (("n", n), ("c", c), ("k", k)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"pass_at_k: {name} must be an int, got {type(value).__name__}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: expected 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: expected 1 <= k <= n, got n={n}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(eval_n: int) -> list[int]:
    """The k reported for `eval_n` responses per prompt: the powers of two below eval_n, and
    eval_n itself (1 -> [1]; 4 -> [1, 2, 4]; 6 -> [1, 2, 4, 6])."""
    if eval_n < 1:
        raise ValueError(f"eval_n: expected an int >= 1, got {eval_n}")
    ks, k = [], 1
    while k < eval_n:
        ks.append(k)
        k *= 2
    return [*ks, eval_n]


def _figures(records: list[Mapping[str, Any]], ks: list[int], threshold: float) -> dict[str, Any]:
    per_prompt: dict[Any, list[bool]] = {}
    rewards: list[float] = []
    failed = 0
    for rec in records:
        reward = rec.get("reward")
        if reward is None:  # generation or scoring failed: counted, and never a pass
            failed += 1
        else:
            rewards.append(float(reward))
        per_prompt.setdefault(rec["prompt"], []).append(
            reward is not None and float(reward) >= threshold)
    pass_at: dict[str, float] = {}
    for k in ks:
        # A prompt with fewer than k responses has no pass@k: it is left out of that k.
        values = [pass_at_k(len(p), sum(p), k) for p in per_prompt.values() if len(p) >= k]
        if values:
            pass_at[str(k)] = sum(values) / len(values)
    return {"prompts": len(per_prompt), "n": len(rewards), "failed": failed,
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "pass_at": pass_at}


def eval_summary(records: Iterable[Mapping[str, Any]], *, eval_n: int | None = None,
                 threshold: float = 1.0) -> dict[str, Any]:
    """One round's figures from its responses. Each record: `prompt` (which eval prompt; any
    hashable), `reward` (float, or None when the response failed), optionally `data_source`.

    Returns {"prompts", "n" (responses with a reward), "failed", "reward_mean" (over the
    responses with a reward; None if none), "pass_at": {"1": ..., "2": ..., str(eval_n): ...}}
    plus "by_source": {source: the same figures} when any record names a data_source (records
    without one are left out of by_source). A response passes when reward >= threshold.
    `eval_n` (responses per prompt) defaults to the most any prompt has."""
    records = list(records)
    if eval_n is None:
        counts: dict[Any, int] = {}
        for rec in records:
            counts[rec["prompt"]] = counts.get(rec["prompt"], 0) + 1
        eval_n = max(counts.values(), default=1)
    ks = pass_ks(eval_n)
    out = _figures(records, ks, threshold)
    sources: dict[str, list[Mapping[str, Any]]] = {}
    for rec in records:
        if rec.get("data_source") is not None:
            sources.setdefault(str(rec["data_source"]), []).append(rec)
    if sources:
        out["by_source"] = {s: _figures(recs, ks, threshold)
                            for s, recs in sorted(sources.items())}
    return out


def eval_metrics(summary: Mapping[str, Any]) -> dict[str, Any]:
    """A round's summary (with its `version`) as the flat keys of a metrics row:
    eval_reward_mean, eval_version, eval_samples, eval_failed, eval_prompts, eval_pass@{k},
    and per data source eval/{source}/reward_mean and eval/{source}/pass@{k}."""
    row: dict[str, Any] = {"eval_reward_mean": summary.get("reward_mean"),
                           "eval_version": summary.get("version"),
                           "eval_samples": summary.get("n"),
                           "eval_failed": summary.get("failed", 0)}
    if summary.get("prompts") is not None:
        row["eval_prompts"] = summary["prompts"]
    for k, v in (summary.get("pass_at") or {}).items():
        row[f"eval_pass@{k}"] = v
    for source, figures in (summary.get("by_source") or {}).items():
        row[f"eval/{source}/reward_mean"] = figures.get("reward_mean")
        for k, v in (figures.get("pass_at") or {}).items():
            row[f"eval/{source}/pass@{k}"] = v
    return row
