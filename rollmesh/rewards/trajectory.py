"""The trajectory view: what a reward function that declares a `trajectory` parameter reads.

A trajectory is one token row (prompt, then generated tokens with loss mask 1 and observation
tokens with mask 0); its view is plain data (it crosses the reward sandbox's pipe):

    {"prompt": str,
     "turns": [{"role": "assistant" | "observation", "text": str, "tokens": int}, ...],
     "tool_calls": [{"name": str | None, "arguments": dict, "result": str}, ...],
     "num_turns": int, "finish_reason": str | None, "agent_loop": str}

The turns split the response at loss-mask boundaries, in order: each maximal run of generated
tokens is an assistant turn (a turn interrupted by a weight sync and resumed is one run, so one
turn), each run of mask-0 tokens an observation (tool results, a user's reply, the chat
template's tokens between turns). Texts are decoded with special tokens skipped. The tool calls
are those the agent loop recorded in `loop_state["calls"]` (`tool_agent`, `openai_agent`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rollmesh.wire.messages import Trajectory

__all__ = ["trajectory_view"]


def trajectory_view(traj: Trajectory, tokenizer: Any) -> dict[str, Any]:
    """`traj` as a reward function reads it (the module docstring)."""
    return {"prompt": _decode(tokenizer, traj.token_ids[:traj.prompt_len]),
            "turns": _turns(traj, tokenizer), "tool_calls": traj.loop_state.get("calls", []),
            "num_turns": traj.num_turns, "finish_reason": traj.finish_reason,
            "agent_loop": traj.agent_loop}


def _turns(traj: Trajectory, tokenizer: Any) -> list[dict[str, Any]]:
    ids, mask = traj.token_ids[traj.prompt_len:], traj.loss_mask[traj.prompt_len:]
    edges = [0, *(np.flatnonzero(np.diff(mask)) + 1).tolist(), len(mask)]
    return [{"role": "assistant" if mask[a] else "observation",
             "text": _decode(tokenizer, ids[a:b]), "tokens": b - a}
            for a, b in zip(edges, edges[1:]) if b > a]


def _decode(tokenizer: Any, ids: np.ndarray) -> str:
    return tokenizer.decode(ids.tolist(), skip_special_tokens=True)
