"""A custom agent loop: answer, then get asked to check the answer, then answer again.

It shows the three things a loop does: generate through `ctx.generate` (tokens appended with
their log-probs and weight version, mask 1), append observation tokens with
`append_observation` (mask 0), and keep all of its progress in `traj.loop_state`, so that a
trajectory interrupted by a weight sync resumes exactly where it stopped, on any worker.
"""

from __future__ import annotations

from rollmesh.agents import LoopContext, Trajectory, append_observation, next_turn_ids

CHECK = [{"role": "user", "content": "Check your answer and give it again."}]


class SelfCheckLoop:
    name = "self_check"

    def __init__(self, ctx: LoopContext):
        self.ctx = ctx

    async def run(self, traj: Trajectory) -> None:
        state = traj.loop_state
        state.setdefault("phase", "answer")
        state.setdefault("turn_start", len(traj.token_ids))
        budget = self.ctx.rollout.max_new_tokens
        if state["phase"] == "answer":
            done = len(traj.token_ids) - state["turn_start"]
            if done < budget:
                await self.ctx.generate(traj, budget - done)  # Interrupted propagates: resumable
            # the user's turn as the model's own chat template writes it
            tok = self.ctx.tokenizer
            ended = int(traj.token_ids[-1]) == tok.eos_token_id
            append_observation(traj, next_turn_ids(tok, CHECK, turn_ended=ended))
            state["phase"], state["turn_start"] = "check", len(traj.token_ids)
        if state["phase"] == "check":
            done = len(traj.token_ids) - state["turn_start"]
            if done < budget:
                await self.ctx.generate(traj, budget - done)
            state["phase"] = "done"
        traj.num_turns = 2
        traj.status = "finished"


class SpoiledTokensLoop:
    """A buggy loop, for the tests: it answers, then appends one token id far past any
    vocabulary as if generated (mask 1). Such a row once crashed the trainer; the rollouter
    now drops its group, reason "invalid"."""

    name = "spoiled_tokens"

    def __init__(self, ctx: LoopContext):
        self.ctx = ctx

    async def run(self, traj: Trajectory) -> None:
        from rollmesh.agents import append_tokens

        await self.ctx.generate(traj, self.ctx.rollout.max_new_tokens)
        append_tokens(traj, [2**30], [-0.5], int(traj.versions.max()))
        traj.status = "finished"
