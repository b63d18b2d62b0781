"""The agent worker role (`role`), its agent loops (`loops`, `openai_agent`) and the tools they
call (`tools`).

The names below are the stable API for a package of agent loops (registered under the
entry-point group `rollmesh.agent_loops`): import them from `rollmesh.agents`; the modules
behind them may move.
"""

from rollmesh.agents.loops import AgentLoop, LoopContext, next_turn_ids
from rollmesh.core.trajectory import append_observation, append_tokens
from rollmesh.wire.messages import Trajectory

__all__ = [
    "AgentLoop",
    "LoopContext",
    "Trajectory",
    "append_observation",
    "append_tokens",
    "next_turn_ids",
]
