"""Prompt filtering the tests use on rows loaded by rollmesh.rollout.data (no role calls it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollmesh.rollout.data import PromptRow, render_prompt
from rollmesh.runtime.log import get_logger

log = get_logger("tests.helpers.prompts")


def drop_long_prompts(
    rows: Sequence[PromptRow],
    tokenizer: Any,
    max_prompt_tokens: int,
    system_prompt: str | None = None,
) -> list[PromptRow]:
    """The rows whose rendered prompt fits in `max_prompt_tokens` (the others are counted and
    logged): run once after loading, so the cursor never draws a prompt that would be skipped."""
    kept = [r for r in rows if len(render_prompt(r, tokenizer, system_prompt)) <= max_prompt_tokens]
    if len(kept) < len(rows):
        log.warning(
            "long_prompts_dropped", dropped=len(rows) - len(kept), kept=len(kept),
            max_prompt_tokens=max_prompt_tokens,
        )
    if not kept:
        raise ValueError(f"every prompt is longer than max_prompt_tokens={max_prompt_tokens}")
    return kept
