"""Evaluation rounds of the held-out set: outside the training accounting.

One round per `rollout.eval_every` versions (version 0 included: the policy before training):
`rollout.eval_n` answers per eval prompt (ids eval-v{version}-{prompt}-{j}, metadata
`eval_version` and `eval_prompt`, sampled at `rollout.eval_temperature`). The rollouter
dispatches them after its cancel queue and before new prompts. An answer a sync interrupts is
resumed like a training trajectory (its partial tokens kept), still labelled by the version its
round started at, so an answer longer than a sync interval still finishes. When the last answer
of a round is scored, the round ends in one `messages.EvalResult` (`last`: the stats' `eval`,
the `eval` log line, and `on_result`, through which the rollouter publishes it to the status
hub for the trainer): mean reward, pass@k and the same per data_source (`rollmesh.core.evaluation`).
"""

from __future__ import annotations

import collections
from typing import Any, Callable

from rollmesh.config import ExperimentConfig
from rollmesh.rollout.data import Dataset, PromptRow, render_prompt
from rollmesh.core.evaluation import eval_summary
from rollmesh.wire.messages import EvalResult, Trajectory
from rollmesh.core.trajectory import new_trajectory

__all__ = ["EvalRounds", "is_eval"]


def is_eval(traj: Trajectory) -> bool:
    return "eval_version" in traj.metadata


class EvalRounds:
    """The rounds started and not yet summarised, their queue of answers not yet dispatched,
    and the last result. `counters`: the rollouter's own (`eval_interrupted`); `on_result`:
    called with each round's result as it ends."""

    def __init__(self, exp: ExperimentConfig, log: Any, counters: collections.Counter[str]):
        self.exp, self.log, self.counters = exp, log, counters
        self.rows = (Dataset.from_config(exp.data, eval=True).rows
                     if exp.rollout.eval_every and exp.data.eval_path else [])
        self.queue: collections.deque[Trajectory] = collections.deque()
        self.runs: dict[int, dict[str, Any]] = {}
        self.last: EvalResult | None = None
        self.on_result: Callable[[EvalResult], None] | None = None
        if self.rows and getattr(exp.rollout, "eval_n", 1) > 1 \
                and exp.rollout.eval_temperature == 0:
            self.log.warning("eval_n_greedy", eval_n=exp.rollout.eval_n,
                             hint="rollout.eval_temperature = 0 samples the same answer "
                                  "eval_n times: pass@k for k > 1 equals pass@1")

    def start(self, version: int, tokenizer: Any,
              loop_metadata: Callable[[PromptRow, str], dict[str, Any]]) -> None:
        """A round at `version`, if one is due: its answers go into the queue, all to be scored,
        summarised when the last one is in (`scored`)."""
        v, every = version, self.exp.rollout.eval_every
        if not self.rows or v % every or v in self.runs:
            return
        eval_n = getattr(self.exp.rollout, "eval_n", 1)
        self.runs[v] = {"n": len(self.rows) * eval_n, "records": [],
                        "resumed": 0, "response_tokens": 0}
        for i, row in enumerate(self.rows):
            prompt = render_prompt(row, tokenizer, self.exp.data.system_prompt)
            for j in range(eval_n):
                loop = row.agent_loop or self.exp.data.default_agent_loop
                self.queue.append(new_trajectory(
                    f"eval-v{v:06d}-{i:04d}-{j:02d}", f"eval-v{v:06d}", i * eval_n + j, prompt,
                    agent_loop=loop, label=row.label,
                    metadata={**row.metadata, **loop_metadata(row, loop),
                              "eval_version": v, "eval_prompt": i,
                              "sampling": {"temperature": self.exp.rollout.eval_temperature}}))

    def returned(self, traj: Trajectory) -> bool:
        """An answer back from its agent worker: True if it is finished and goes to be scored;
        an interrupted one goes back to the head of the queue, a failed one counts as scored
        (a failure)."""
        if traj.status == "finished":
            return True
        if traj.status == "interrupted":
            # Resumed like a training trajectory: its partial tokens are kept (an answer
            # longer than a sync interval still finishes); it stays labelled by the version
            # its round started at (metadata eval_version).
            self.counters["eval_interrupted"] += 1
            self.queue.appendleft(traj)
        else:
            self.scored(traj)
        return False

    def scored(self, traj: Trajectory) -> None:
        run = self.runs.get(traj.metadata["eval_version"])
        if run is None:
            return
        ok = traj.status == "finished" and traj.reward_status == "ok"
        run["records"].append({"prompt": traj.metadata.get("eval_prompt", traj.index),
                               "reward": traj.reward if ok else None,  # None: failed
                               "data_source": traj.metadata.get("data_source")})
        generated = traj.versions[traj.loss_mask == 1]
        run["response_tokens"] += int(generated.size)
        run["resumed"] += int(len(set(generated.tolist())) > 1)  # went on across a sync
        if len(run["records"]) == run["n"]:
            v = traj.metadata["eval_version"]
            summary = eval_summary(run["records"], eval_n=getattr(self.exp.rollout, "eval_n", 1),
                                   threshold=getattr(self.exp.rollout, "eval_pass_threshold",
                                                     1.0))
            self.last = EvalResult(version=v, **summary, answers_resumed=run["resumed"],
                                   response_tokens=run["response_tokens"])
            del self.runs[v]
            self.log.info("eval", **self.last.summary())
            if self.on_result is not None:
                self.on_result(self.last)
