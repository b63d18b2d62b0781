"""Typed configuration: TOML files -> validated dataclasses, and back to TOML for the logs.

This module owns the schema of the two kinds of config file and every rule about them:

- an experiment file (`configs/*.toml`) -> `ExperimentConfig`, one dataclass per component
  (model, data, rollout, staleness, algorithm, trainer, sync, engine);
- a cluster file (`launch/*.toml`) -> `ClusterConfig`: hosts, where each role runs, ports,
  and the experiment it launches (`cluster.experiment_config`).

The schema is the dataclasses below; one generic validator walks their type hints, so a field
declared here is parsed, checked and documented (its `help`) with no further code. Every error is
a `ConfigError` naming the file (or the `--set` override), the dotted key path and what was
expected, e.g. `configs/x.toml: staleness.max_staleness: expected int >= 0, got -1`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import importlib.metadata
import json
import math
import os
import re
import tomllib
import types
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field
from typing import Any, Literal, NamedTuple, NoReturn, Union, get_args, get_origin, get_type_hints

from rollmesh.cpus import CpuListError, parse_cpulist

__all__ = [
    "AlgorithmConfig",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "EngineConfig",
    "ExperimentConfig",
    "HostConfig",
    "ModelConfig",
    "Placement",
    "PortsConfig",
    "Process",
    "PythonToolConfig",
    "ROLES",
    "RolesConfig",
    "RolloutConfig",
    "SINGLETON_ROLES",
    "SlurmConfig",
    "StalenessConfig",
    "SyncConfig",
    "TrainerConfig",
    "apply_overrides",
    "field_reference",
    "load_cluster",
    "load_experiment",
    "parse_config",
    "to_dict",
    "to_toml",
]


class ConfigError(ValueError):
    """A config value is wrong: `str(err)` is `<file or --set override>: <key path>: <problem>`."""

    def __init__(self, source: str, key: str, problem: str) -> None:
        self.source, self.key, self.problem = source, key, problem
        super().__init__(f"{source}: {key}: {problem}" if key else f"{source}: {problem}")


class _Invalid(Exception):
    """Raised by a `validate()` hook with a key path relative to its dataclass; the parser adds
    the file and the path prefix."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(key, problem)
        self.key, self.problem = key, problem


def _field(help: str, default: Any = MISSING, *, factory: Any = MISSING, **bounds: float) -> Any:
    """A config field: `help` is mandatory (it becomes the README's reference); `bounds` are any
    of ge/gt/le/lt, applied to the value (to each item for a list)."""
    assert help and set(bounds) <= {"ge", "gt", "le", "lt"}, bounds
    return field(default=default, default_factory=factory, metadata={"help": help, **bounds})


Dtype = Literal["float32", "bfloat16", "float16"]
DistBackend = Literal["auto", "gloo", "nccl"]


# ---------------------------------------------------------------------------------------------
# Experiment file
# ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ModelConfig:
    path: str = _field(
        "policy checkpoint: a local Hugging Face model directory, or `tiny` / `tiny:<spec>` for a "
        "randomly initialised tiny model (tests, CPU runs)"
    )
    tokenizer_path: str | None = _field("tokenizer directory (default: the model path)", None)
    dtype: Dtype = _field("parameter dtype for training and inference", "float32")
    trust_remote_code: bool = _field("allow the checkpoint's own modelling code to run", False)
    max_context: int = _field("longest sequence (prompt + response) in tokens", 4096, gt=0)


@dataclass(kw_only=True)
class DataConfig:
    train_path: str = _field(
        "training prompts: a .jsonl or .parquet file, or a Hugging Face `datasets` directory "
        "(DIR or DIR:SPLIT; relative to the working directory)"
    )
    eval_path: str | None = _field(
        "evaluation prompts, same format (needed if eval_every > 0)", None
    )
    format: Literal["auto", "jsonl", "parquet", "gsm8k", "verl", "hf"] = _field(
        "file format; `auto` goes by the extension; `gsm8k` is JSONL whose label is the text "
        "after '####' in label_key; `verl` is verl's Parquet schema as its data-preparation "
        "scripts write it (`prompt` a chat message list, `reward_model.ground_truth` the label, "
        "`data_source`, `extra_info`); `hf` a Hugging Face `datasets` directory written by "
        "`save_to_disk` (the `datasets` extra)",
        "auto",
    )
    prompt_key: str = _field(
        "row field holding the prompt (a string or a chat message list)", "prompt"
    )
    label_key: str = _field("row field holding the reference answer given to the reward", "label")
    shuffle: bool = _field("shuffle the prompts each epoch", True)
    seed: int | None = _field("shuffle seed (default: the top-level seed)", None)
    group_size: int = _field("responses sampled per prompt (the GRPO/RLOO group)", 8, ge=1)
    default_agent_loop: str = _field(
        "agent loop for rows that name none (entry point in `rollmesh.agent_loops`)", "single_turn"
    )
    system_prompt: str | None = _field("system message prepended to every prompt", None)
    max_prompt_tokens: int = _field("prompts longer than this are skipped (tokens)", 1024, gt=0)

    def validate(self) -> None:
        _check_registered("default_agent_loop", self.default_agent_loop, "rollmesh.agent_loops")


@dataclass(kw_only=True)
class PythonToolConfig:
    cpu_s: int = _field(
        "CPU seconds the code may use, per process (RLIMIT_CPU); more ends it with an error "
        "naming the limit", 10, ge=1)
    wall_s: float = _field(
        "wall-clock seconds a call may run before all its processes are killed (never more "
        "than rollout.tool_timeout_s less a second)", 20.0, gt=0)
    memory_mb: int = _field(
        "memory per process, MiB of data (RLIMIT_DATA; the address space is capped at 4 times "
        "this)", 512, ge=32)
    file_mb: int = _field("largest file the code may write, MiB (RLIMIT_FSIZE)", 16, ge=1)
    max_processes: int = _field(
        "processes and threads the code may run at once, itself included (RLIMIT_NPROC)", 8,
        ge=1)
    max_output: int = _field(
        "bytes of output (stdout and stderr together) returned to the model; beyond that its "
        "head and tail are kept, with a note of what was left out", 8192, ge=256)
    site_packages: bool = _field(
        "let the code import the packages installed beside rollmesh (numpy, sympy, ...); "
        "otherwise the standard library only", False)


@dataclass(kw_only=True)
class RolloutConfig:
    max_new_tokens: int = _field("tokens generated per turn at most", 1024, gt=0)
    temperature: float = _field("sampling temperature (0 = greedy)", 1.0, ge=0)
    top_p: float = _field("nucleus sampling mass", 1.0, gt=0, le=1)
    top_k: int = _field("sample from the k most likely tokens (-1 = whole vocabulary)", -1)
    max_concurrent: int = _field("prompt groups being generated at once, at most", 64, gt=0)
    batch_groups: int = _field("prompt groups per trainer step", 8, gt=0)
    max_turns: int = _field("assistant turns per trajectory in multi-turn agent loops", 8, ge=1)
    tool_timeout_s: float = _field("time limit for one tool call (seconds)", 30.0, gt=0)
    python_tool: PythonToolConfig = _field(
        "limits of the `python` tool (code execution)", factory=PythonToolConfig)
    openai_agent: str = _field(
        "the agent of the `openai_agent` loop, 'package.module:function': an async function "
        "called as `await fn(client, row)` with an `openai.AsyncOpenAI` client (a row's own "
        "`openai_agent` field wins; '' = rows must name theirs)", "")
    max_retries: int = _field(
        "retries of a generation that failed (engine error) before its whole group is dropped", 2, ge=0
    )
    engine_wait_s: float = _field(
        "how long a generation waits through an engine outage (no engine healthy, or its engine "
        "died: it moves to another) before it counts as failed (seconds); meanwhile no new "
        "prompt is admitted", 300.0, gt=0)
    over_sampling: float = _field(
        "prompt groups admitted per group needed (> 1 makes up for groups the filter drops)",
        1.0,
        ge=1.0,
    )
    group_filter: str = _field(
        "`none`, `dapo` (drop groups whose rewards are all equal: no learning signal), or a "
        "filter registered under the entry-point group `rollmesh.group_filters`",
        "none",
    )
    reward: str = _field("reward function (entry point in `rollmesh.rewards`)", "exact_match")
    reward_timeout_s: float = _field("time limit for scoring one trajectory (seconds)", 30.0, gt=0)
    reward_memory_mb: int = _field(
        "memory limit of each reward function's sandbox process (MiB of data: heap and "
        "anonymous mappings); a function that allocates more fails with reward_status error",
        2048, ge=64)
    eval_every: int = _field(
        "evaluate the held-out set (data.eval_path) every N weight versions, alongside training "
        "(0 = never)", 0, ge=0)
    eval_temperature: float = _field("sampling temperature of evaluation (0 = greedy)", 0.0, ge=0)
    eval_n: int = _field(
        "responses sampled per evaluation prompt; the eval row reports pass@k for k = 1, 2, "
        "4, ... up to eval_n (unbiased estimator)", 1, ge=1)
    eval_pass_threshold: float = _field(
        "an evaluation response counts as passed (for pass@k) when its reward is at least this",
        1.0)

    def validate(self) -> None:
        if self.top_k != -1 and self.top_k < 1:
            raise _Invalid("top_k", f"expected -1 (whole vocabulary) or int >= 1, got {self.top_k}")
        module, _, function = self.openai_agent.partition(":")
        if self.openai_agent and not (module and function):
            raise _Invalid("openai_agent", f"expected 'package.module:function' (or ''), got "
                                           f"{self.openai_agent!r}")
        if ":" not in self.reward:  # "module:function" is imported by the reward worker
            _check_registered("reward", self.reward, "rollmesh.rewards", extra=" or 'module:function'")
        _check_registered("group_filter", self.group_filter, "rollmesh.group_filters",
                          builtin=("none", "dapo"))


@dataclass(kw_only=True)
class StalenessConfig:
    max_staleness: int = _field(
        "how many weight versions a sample may lag the trainer (0 = synchronous on-policy)",
        1,
        ge=0,
    )
    sync_mode: bool = _field(
        "the synchronous on-policy baseline: max_staleness is taken as 0, so the rollout "
        "generates exactly one batch per weight version and idles while the trainer steps",
        False,
    )

    def __post_init__(self) -> None:
        # One switch selects the baseline users compare asynchronous training against. A
        # max_staleness other than 0 or the default beside it is a contradiction: validate()
        # names it rather than silently dropping the value the user wrote.
        if self.sync_mode and self.max_staleness in (0, 1):
            self.max_staleness = 0

    def validate(self) -> None:
        if self.sync_mode and self.max_staleness != 0:
            raise _Invalid(
                "max_staleness",
                f"expected 0 (or no value) with sync_mode = true (the synchronous on-policy "
                f"baseline), got {self.max_staleness}",
            )


@dataclass(kw_only=True)
class AlgorithmConfig:
    advantage: Literal["grpo", "grpo_mean_only", "rloo", "reinforce_pp", "gae"] = _field(
        "advantage estimator (formulas: README, Algorithms)", "grpo"
    )
    loss: Literal["ppo", "decoupled_ppo", "tis", "gspo", "cispo"] = _field(
        "policy loss: clipped PPO, decoupled PPO (AReaL, for stale samples), truncated "
        "importance sampling, GSPO (one clipped ratio per sequence) or CISPO (the clipped ratio "
        "as a stop-gradient weight of the REINFORCE term)",
        "ppo",
    )
    clip_low: float = _field(
        "ratio clip below 1 (ratio >= 1 - clip_low): PPO's, and CISPO's weight clip (>= 1: no "
        "lower bound, as MiniMax-M1)", 0.2, gt=0)
    clip_high: float = _field(
        "ratio clip above 1 (0.28 = DAPO clip-higher): PPO's, and CISPO's weight clip", 0.2, gt=0)
    gspo_clip_low: float = _field(
        "gspo: clip of the sequence ratio below 1 (the GSPO paper: 3e-4; it is the exp of a mean "
        "log-ratio, far narrower than a token ratio)", 3e-4, gt=0)
    gspo_clip_high: float = _field("gspo: clip of the sequence ratio above 1 (the GSPO paper: "
                                   "4e-4)", 4e-4, gt=0)
    dual_clip: float | None = _field(
        "dual-clip bound for negative advantages (e.g. 3.0; ppo, decoupled_ppo, tis)", None, gt=1
    )
    tis_cap: float = _field("upper bound of the truncated importance weight", 2.0, gt=0)
    tis_surrogate: Literal["ppo", "pg"] = _field(
        "tis: the surrogate the truncated weight multiplies: `ppo` (the clipped PPO term) or `pg` "
        "(vanilla policy gradient, -w * A * log p)", "ppo")
    behaviour_cap: float | None = _field(
        "decoupled_ppo: upper bound of the behaviour importance weight exp(proximal - behaviour) "
        "(none = uncapped)",
        None,
        gt=0,
    )
    behaviour_cap_mode: Literal["truncate", "mask"] = _field(
        "decoupled_ppo: a behaviour weight above behaviour_cap is cut to the cap (`truncate`) or "
        "its token dropped from the loss sum (`mask`, AReaL's recommendation, e.g. cap 5)",
        "truncate")
    old_logprobs: Literal["recompute", "bypass"] = _field(
        "old log-probs: recomputed by the trainer, or the engine's behaviour log-probs as-is",
        "recompute",
    )
    kl_coef: float = _field("weight of the KL penalty to the reference model (0 = off)", 0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3", "k3+"] = _field(
        "KL estimator (k3 = low-variance; k3+ = k3's value with k2's gradient, straight-through, "
        "as verl: the gradient of KL, bounded, for the KL loss; k3 in the reward)", "k3")
    kl_clamp: float | None = _field(
        "bound on each token's k3 / k3+ KL value, [-kl_clamp, kl_clamp]; verl and AReaL clamp at "
        "10, which also zeroes k3's gradient of a token beyond it (log ratio < -2.6); none (the "
        "default) keeps every token's full k3 value and gradient", None, gt=0)
    kl_in_reward: bool = _field("apply the KL penalty to the reward instead of the loss", False)
    entropy_coef: float = _field("weight of the entropy bonus", 0.0, ge=0)
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"] = _field(
        "how per-token losses are averaged over a batch; seq-mean-token-sum-norm = Dr. GRPO's: "
        "each sequence's token sum over the constant loss_norm_tokens, then the mean over "
        "sequences", "token-mean"
    )
    loss_norm_tokens: int | None = _field(
        "seq-mean-token-sum-norm: the constant each sequence's token sum is divided by (none = "
        "rollout.max_new_tokens)", None, gt=0)
    reward_scale: float = _field("multiplies every reward before the advantage", 1.0, gt=0)
    reward_clip: float | None = _field(
        "bound on the shaped reward, [-reward_clip, reward_clip], after scale and overlong "
        "penalty (none = unbounded)", None, gt=0)
    overlong_buffer: int = _field(
        "DAPO soft overlong penalty: over the last overlong_buffer tokens before "
        "overlong_max_tokens the reward falls linearly by up to overlong_penalty (0 = off)",
        0, ge=0)
    overlong_penalty: float = _field(
        "the overlong penalty at overlong_max_tokens generated tokens (DAPO: 1.0)", 1.0, ge=0)
    overlong_max_tokens: int | None = _field(
        "the response length the overlong penalty reaches its full size at (none = "
        "rollout.max_new_tokens)", None, gt=0)
    mask_truncated: bool = _field(
        "drop responses cut off by the length limit (finish reason `length`: no EOS) from the "
        "loss (DAPO overlong filtering); their rewards still count in their group's baseline",
        False)
    bootstrap_truncated: bool = _field(
        "gae: a response cut off by the length limit did not end: its last token's return "
        "bootstraps with gamma x the critic's value of the state after it instead of 0",
        False)
    gamma: float = _field("discount factor (gae, reinforce_pp)", 1.0, ge=0, le=1)
    lam: float = _field("GAE lambda", 1.0, ge=0, le=1)
    critic_lr: float | None = _field(
        "gae: peak learning rate of the critic (value model: the policy's architecture with a "
        "scalar value head, its own AdamW, the trainer's warm-up and schedule); required with "
        "advantage = 'gae'",
        None,
        gt=0,
    )
    value_clip: float | None = _field(
        "gae: clip range of the clipped value loss around the step's old values (none = unclipped)",
        0.5,
        gt=0,
    )
    use_reference: bool = _field("compute reference-model log-probs (needed by kl_coef > 0)", False)

    def validate(self) -> None:
        if self.advantage == "gae" and self.critic_lr is None:
            raise _Invalid(
                "critic_lr",
                "missing required value (expected float > 0, as advantage = 'gae' trains a critic)",
            )
        if self.kl_coef > 0 and not self.use_reference:
            raise _Invalid(
                "use_reference",
                "expected true when kl_coef > 0 (the KL term needs reference log-probs), got false",
            )
        if self.loss in ("decoupled_ppo", "tis") and self.old_logprobs == "bypass":
            # Both corrections compare recomputed and behaviour log-probs: bypass makes them no-ops.
            raise _Invalid(
                "old_logprobs", f"expected 'recompute' with loss = '{self.loss}', got 'bypass'"
            )
        if self.behaviour_cap_mode == "mask" and self.behaviour_cap is None:
            raise _Invalid("behaviour_cap", "missing required value (expected float > 0, as "
                           "behaviour_cap_mode = 'mask' drops tokens above it)")
        if self.bootstrap_truncated and self.advantage != "gae":
            raise _Invalid("bootstrap_truncated", f"expected false with advantage = "
                           f"'{self.advantage}' (only gae has a critic's value to bootstrap "
                           "with), got true")
        if self.bootstrap_truncated and self.mask_truncated:
            raise _Invalid("bootstrap_truncated", "expected false with mask_truncated = true "
                           "(truncated responses are not trained on), got true")


@dataclass(kw_only=True)
class TrainerConfig:
    lr: float = _field("peak learning rate (AdamW)", 1e-6, gt=0)
    weight_decay: float = _field("AdamW weight decay", 0.01, ge=0)
    betas: list[float] = _field("AdamW betas, two values", factory=lambda: [0.9, 0.999], ge=0, lt=1)
    grad_clip: float = _field("gradient norm clip", 1.0, gt=0)
    warmup_steps: int = _field("linear warm-up steps", 0, ge=0)
    total_steps: int = _field("trainer steps in the run", 1000, gt=0)
    lr_schedule: Literal["constant", "cosine"] = _field(
        "learning-rate schedule after warm-up", "constant"
    )
    mini_batches: int = _field("optimizer updates per trainer step (PPO mini-batches)", 1, ge=1)
    micro_batch_tokens: int = _field(
        "tokens per forward/backward pass, padding included: sequences are sorted by length and "
        "cut into micro-batches of at most this many (rows x longest row) tokens",
        16384,
        gt=0,
    )
    gradient_checkpointing: bool = _field("recompute activations in backward to save memory", False)
    ranks: int = _field("trainer processes (data parallel)", 1, ge=1)
    backend: DistBackend = _field(
        "torch.distributed backend between ranks (auto: nccl on GPU)", "auto"
    )
    checkpoint_every: int = _field("save a checkpoint every N steps (0 = only at the end)", 0, ge=0)
    checkpoint_dir: str | None = _field(
        "checkpoint directory (default: <run dir>/checkpoints)", None
    )
    seed: int | None = _field("trainer seed (default: the top-level seed)", None)
    device: Literal["auto", "cpu", "cuda"] = _field(
        "training device (auto: cuda if present)", "auto"
    )
    max_restarts: int = _field(
        "times the launcher restarts the trainer ranks after they die (from the latest "
        "checkpoint, with back-off, the rollout side running on); 0: a dead trainer stops the "
        "run (go on with `rollmesh launch --resume RUN`)", 3, ge=0)
    progress_timeout_s: float = _field(
        "stop the run with an error naming the cause when the trainer makes no step for this "
        "long while samples are dropped or nothing is generated (seconds; 0: never)", 600.0, ge=0)

    def validate(self) -> None:
        if len(self.betas) != 2:
            raise _Invalid("betas", f"expected a list of 2 floats, got {_show(self.betas)}")
        if self.warmup_steps > self.total_steps:
            raise _Invalid(
                "warmup_steps",
                f"expected int <= total_steps ({self.total_steps}), got {self.warmup_steps}",
            )


@dataclass(kw_only=True)
class SyncConfig:
    sync_every: int = _field("trainer steps per weight sync", 1, ge=1)
    bucket_mb: float = _field("size of one weight broadcast bucket (MiB)", 512.0, gt=0)
    backend: DistBackend = _field("weight broadcast backend (auto: nccl on GPU, else gloo)", "auto")
    pause_mode: Literal["abort", "in_place"] = _field(
        "how engines pause for a sync: abort in-flight requests (resumed later) or keep them",
        "abort",
    )
    timeout_s: float = _field("time limit for one weight sync (seconds)", 600.0, gt=0)
    load_format: Literal["tensor", "flattened_bucket"] = _field(
        "how a bucket travels: `tensor` = one broadcast per tensor (the contract), "
        "`flattened_bucket` = one broadcast of the bucket's bytes back to back (SGLang's "
        "load_format of that name; fewer, larger collectives, pipelined); SGLang and the "
        "built-in engine take both",
        "tensor",
    )
    overlap: bool = _field(
        "send the weights while the trainer computes its next step: at a sync, trainer rank 0 "
        "copies them into a snapshot (one more copy of the model in the engines' dtype: on the "
        "GPU when it fits there, else in pinned host memory; on CPU, host memory) and sends "
        "that from a background thread; the next sync or checkpoint waits for it, and the "
        "engines receive exactly the snapshot under its version. false: the trainer waits "
        "for each broadcast (no extra memory)",
        False,
    )


@dataclass(kw_only=True)
class EngineConfig:
    kind: Literal["builtin", "sglang"] = _field(
        "inference server: rollmesh's built-in engine (CPU or GPU) or SGLang", "builtin"
    )
    count: int = _field("engine servers (must match the cluster file's engine processes)", 1, ge=1)
    tp_size: int = _field("tensor-parallel GPUs per engine server", 1, ge=1)
    mem_fraction_static: float = _field(
        "SGLang: GPU memory share for weights and KV cache", 0.8, gt=0, le=1
    )
    max_running_requests: int = _field("requests one engine runs at once, at most", 256, gt=0)
    extra_args: list[str] = _field(
        "extra command-line arguments for the engine server", factory=list
    )
    startup_timeout_s: float = _field(
        "time limit for an engine to become healthy (seconds)", 600.0, gt=0
    )
    max_restarts: int = _field(
        "times the launcher restarts an engine that died within any 10 minutes (a crash loop "
        "beyond it ends the run)", 5, ge=0)

    def validate(self) -> None:
        if self.kind == "builtin" and self.tp_size != 1:
            raise _Invalid("tp_size", f"expected 1 for kind = 'builtin', got {self.tp_size}")
        if self.kind == "builtin" and self.extra_args:
            # the engine's own parser, now, rather than a usage line in its log after launch
            from rollmesh.engine.sglang import EngineArgsError, check_builtin_args

            try:
                check_builtin_args(self.extra_args)
            except EngineArgsError as e:
                raise _Invalid("extra_args", str(e).removeprefix("engine.extra_args: ")) from None


@dataclass(kw_only=True)
class MetricsConfig:
    wandb_project: str | None = _field(
        "log every metrics row and the resolved config to this Weights & Biases project, from "
        "the trainer's rank 0 (the `wandb` extra; none = no W&B)", None)
    wandb_entity: str | None = _field("W&B entity (team or user; default: yours)", None)
    wandb_run_name: str | None = _field("W&B run name (default: the run directory's name)", None)
    wandb_mode: Literal["online", "offline", "disabled"] = _field(
        "W&B mode: `offline` writes the run under RUN/wandb to `wandb sync` later; the "
        "WANDB_MODE environment variable overrides it", "online")
    wandb_tags: list[str] = _field("W&B run tags", factory=list)


@dataclass(kw_only=True)
class SftConfig:
    init: str | None = _field(
        "`rollmesh sft`: the checkpoint the supervised warm-start starts from (a local Hugging "
        "Face directory or `tiny[:spec]`); it writes the result to `model.path`, the policy RL "
        "then starts from", None)
    data_path: str | None = _field(
        "`rollmesh sft`: demonstrations, a .jsonl file of chat transcripts (`{\"messages\": "
        "[...]}` per line), rendered by the tokenizer's chat template; the loss is on the "
        "assistant messages' tokens", None)
    steps: int = _field("`rollmesh sft`: optimizer steps", 300, gt=0)
    batch_size: int = _field("`rollmesh sft`: transcripts per optimizer step", 32, gt=0)
    lr: float | None = _field("`rollmesh sft`: peak learning rate (default: trainer.lr), "
                              "linear warm-up, then cosine decay to 0", None, gt=0)
    warmup_steps: int = _field("`rollmesh sft`: linear warm-up steps", 10, ge=0)

    def validate(self) -> None:
        if self.warmup_steps > self.steps:
            raise _Invalid("warmup_steps",
                           f"expected int <= steps ({self.steps}), got {self.warmup_steps}")


@dataclass(kw_only=True)
class ExperimentConfig:
    name: str | None = _field("experiment name, for logs", None)
    seed: int = _field("base seed; data.seed and trainer.seed default to it", 1)
    model: ModelConfig = _field("the policy model")
    data: DataConfig = _field("the prompt dataset")
    rollout: RolloutConfig = _field("generation, agent loops and rewards", factory=RolloutConfig)
    staleness: StalenessConfig = _field("off-policy bound", factory=StalenessConfig)
    algorithm: AlgorithmConfig = _field("advantage and loss", factory=AlgorithmConfig)
    trainer: TrainerConfig = _field("optimisation and checkpoints", factory=TrainerConfig)
    sync: SyncConfig = _field("weight synchronisation to the engines", factory=SyncConfig)
    engine: EngineConfig = _field("inference servers", factory=EngineConfig)
    metrics: MetricsConfig = _field("where metrics go besides metrics.jsonl (W&B)",
                                    factory=MetricsConfig)
    sft: SftConfig = _field("the supervised warm-start (`rollmesh sft`)", factory=SftConfig)

    def __post_init__(self) -> None:
        # Resolved here so that the logged config shows the seeds actually used.
        if self.data.seed is None:
            self.data.seed = self.seed
        if self.trainer.seed is None:
            self.trainer.seed = self.seed
        # The generation budget is the default length of these two (see their help).
        if self.algorithm.loss_norm_tokens is None:
            self.algorithm.loss_norm_tokens = self.rollout.max_new_tokens
        if self.algorithm.overlong_max_tokens is None:
            self.algorithm.overlong_max_tokens = self.rollout.max_new_tokens

    def validate(self) -> None:
        needed = self.data.max_prompt_tokens + self.rollout.max_new_tokens
        if self.model.max_context < needed:
            raise _Invalid(
                "model.max_context",
                f"expected int >= {needed} (data.max_prompt_tokens + rollout.max_new_tokens), "
                f"got {self.model.max_context}",
            )
        # Group-relative advantages and the DAPO filter compare responses within a group.
        if self.data.group_size < 2:
            if self.algorithm.advantage in ("grpo", "grpo_mean_only", "rloo"):
                why = f"algorithm.advantage = '{self.algorithm.advantage}'"
            elif self.rollout.group_filter == "dapo":
                why = "rollout.group_filter = 'dapo'"
            else:
                why = ""
            if why:
                raise _Invalid(
                    "data.group_size", f"expected int >= 2 with {why}, got {self.data.group_size}"
                )
        algo = self.algorithm
        if algo.overlong_buffer and algo.overlong_buffer > (algo.overlong_max_tokens or 0):
            raise _Invalid(
                "algorithm.overlong_buffer",
                f"expected int <= {algo.overlong_max_tokens} (algorithm.overlong_max_tokens, by "
                f"default rollout.max_new_tokens), got {algo.overlong_buffer}",
            )
        if self.sync.sync_every > self.staleness.max_staleness + 1:
            # Just before a sync the trainer is sync_every - 1 versions ahead of the engines.
            raise _Invalid(
                "sync.sync_every",
                f"expected int <= {self.staleness.max_staleness + 1} (staleness.max_staleness + 1, "
                f"or samples go stale before the next sync), got {self.sync.sync_every}",
            )
        samples = self.rollout.batch_groups * self.data.group_size
        if self.trainer.mini_batches > samples:
            raise _Invalid(
                "trainer.mini_batches",
                f"expected int <= {samples} (rollout.batch_groups x data.group_size: the samples "
                f"of one trainer step), got {self.trainer.mini_batches}",
            )
        if self.rollout.eval_every > 0 and self.data.eval_path is None:
            raise _Invalid(
                "data.eval_path",
                "missing required value "
                f"(expected str, as rollout.eval_every = {self.rollout.eval_every})",
            )


# ---------------------------------------------------------------------------------------------
# Cluster file
# ---------------------------------------------------------------------------------------------

SINGLETON_ROLES = frozenset({"rollouter", "message_queue", "synchronizer"})


@dataclass(kw_only=True)
class HostConfig:
    address: str = _field("host name or IP address to reach it (127.0.0.1/localhost: no SSH)")
    user: str | None = _field("SSH user (default: ssh's own default)", None)
    port: int = _field("SSH port", 22, ge=1, le=65535)
    identity_file: str | None = _field(
        "SSH private key on the launching machine (must exist)", None
    )
    python: str = _field(
        "Python interpreter on the host (e.g. a virtualenv's bin/python)", "python3"
    )
    workdir: str | None = _field(
        "directory the processes start in (default: the launcher's current directory on a local "
        "host, the login directory over SSH)",
        None,
    )
    env: dict[str, str] = _field(
        "extra environment variables for every process on the host", factory=dict
    )
    gpus: int = _field("GPUs on the host (ids 0 .. gpus-1)", 0, ge=0)
    launch: Literal["auto", "local", "ssh", "slurm"] = _field(
        "how processes start there: `auto` (local processes when the address is this machine, "
        "else SSH), `local`, `ssh` (always through sshd, e.g. another user on this machine), or "
        "`slurm` (job steps through srun; set by [slurm], which fills the hosts)",
        "auto",
    )
    ssh_options: list[str] = _field(
        "extra `ssh -o` options, e.g. \"UserKnownHostsFile=/path/known_hosts\" (host-key "
        "checking stays on)",
        factory=list,
    )

    def validate(self) -> None:
        for i, opt in enumerate(self.ssh_options):
            # ssh reads `-o` like a config line: "Key=value", "Key value" and "Key = value".
            if re.split(r"[\s=]", opt.strip(), maxsplit=1)[0].lower() == "stricthostkeychecking":
                raise _Invalid(f"ssh_options[{i}]", "host-key checking stays on: "
                               "add the host's key to a known_hosts file instead")
        if self.identity_file is not None and not os.path.isfile(
            os.path.expanduser(self.identity_file)
        ):
            raise _Invalid(
                "identity_file", f"expected an existing file, got {_show(self.identity_file)}"
            )


@dataclass(kw_only=True)
class Placement:
    host: str = _field("name of the host (a [hosts.<name>] table) the processes run on")
    count: int = _field("processes of this role on the host", 1, ge=1)
    gpus: list[int] = _field(
        "GPU ids on the host, split evenly among the processes in order (empty: CPU only)",
        factory=list,
        ge=0,
    )
    cpus: str | list[str] | None = _field(
        "CPUs the processes may use: a Linux cpulist of the host's CPU ids (\"0-3,8\") for "
        "every process of this placement, or a list of one per process; OMP_NUM_THREADS, "
        "MKL_NUM_THREADS and a trainer's torch threads follow (the number of CPUs) unless the "
        "host's `env` sets OMP_NUM_THREADS. Unset: not pinned (README: CPU placement)",
        None,
    )

    def validate(self) -> None:
        if isinstance(self.cpus, list):
            if len(self.cpus) != self.count:
                raise _Invalid("cpus", f"expected one cpulist per process ({self.count}, as "
                               f"count), or one string for all, got {_show(self.cpus)}")
            for i, text in enumerate(self.cpus):
                _check_cpulist(f"cpus[{i}]", text)
        elif self.cpus is not None:
            _check_cpulist("cpus", self.cpus)

    def cpus_of(self, j: int) -> tuple[int, ...]:
        """The CPUs of this placement's `j`-th process (empty: not pinned)."""
        if self.cpus is None:
            return ()
        return parse_cpulist(self.cpus[j] if isinstance(self.cpus, list) else self.cpus)


def _check_cpulist(key: str, text: str) -> None:
    try:
        parse_cpulist(text)
    except CpuListError as e:
        raise _Invalid(key, str(e)) from None


@dataclass(kw_only=True)
class RolesConfig:
    """Where each role runs: one `[roles.<role>]` table, or `[[roles.<role>]]` per host."""

    engine: list[Placement] = _field("inference servers")
    rollouter: list[Placement] = _field("the rollouter (one process)")
    agent_worker: list[Placement] = _field("agent-loop workers")
    reward_worker: list[Placement] = _field("reward workers")
    message_queue: list[Placement] = _field("the MessageQueue (one process)")
    trainer: list[Placement] = _field("trainer ranks")
    synchronizer: list[Placement] = _field("the parameter synchronizer (one process)")

    def validate(self) -> None:
        for role in ROLES:
            placements: list[Placement] = getattr(self, role)
            if not placements:
                raise _Invalid(role, "expected at least one placement, got []")
            if role in SINGLETON_ROLES:
                if len(placements) > 1:
                    raise _Invalid(
                        role,
                        f"expected one placement ({role} is a single process), "
                        f"got {len(placements)}",
                    )
                if placements[0].count != 1:
                    raise _Invalid(
                        f"{role}.count",
                        f"expected 1 ({role} is a single process), got {placements[0].count}",
                    )
            for i, p in enumerate(placements):
                if len(p.gpus) % p.count:
                    raise _Invalid(
                        f"{_placement_key(role, i, len(placements))}.gpus",
                        "expected a list whose length is a multiple of count "
                        f"({p.count}), got {_show(p.gpus)}",
                    )


ROLES = tuple(f.name for f in dataclasses.fields(RolesConfig))  # in launch and port-plan order


@dataclass(kw_only=True)
class PortsConfig:
    """Each process gets `per_process` consecutive ports; the launcher's block comes first at
    `base`, then every role without an explicit port, in role order."""

    base: int = _field(
        "first port of the automatic plan (the launcher's own block)", 28000, ge=1024, le=65535
    )
    per_process: int = _field("consecutive ports reserved for each process", 4, ge=1, le=64)
    engine: int | None = _field("first port of the engine servers (HTTP)", None, ge=1024, le=65535)
    rollouter: int | None = _field("first port of the rollouter", None, ge=1024, le=65535)
    agent_worker: int | None = _field(
        "first port of the agent-loop workers", None, ge=1024, le=65535
    )
    reward_worker: int | None = _field("first port of the reward workers", None, ge=1024, le=65535)
    message_queue: int | None = _field("first port of the MessageQueue", None, ge=1024, le=65535)
    trainer: int | None = _field(
        "first port of the trainer ranks (rank 0: rendezvous)", None, ge=1024, le=65535
    )
    synchronizer: int | None = _field(
        "first port of the parameter synchronizer", None, ge=1024, le=65535
    )


class Process(NamedTuple):
    """One process of the launch plan."""

    role: str
    index: int  # 0.. within its role, across placements
    host: str  # a key of ClusterConfig.hosts
    gpus: tuple[int, ...]
    port: int  # the first of ports.per_process consecutive ports it may bind
    cpus: tuple[int, ...] = ()  # the CPUs it may use (empty: not pinned)

    @property
    def name(self) -> str:
        return f"{self.role}[{self.index}]"


@dataclass(kw_only=True)
class SlurmConfig:
    """`[slurm]` (or `hosts = "slurm"`): hosts node0..nodeN-1 from the Slurm allocation
    (rollmesh.slurm); each process a job step (srun). Needs a filesystem shared by the nodes."""

    nodes: int = _field("nodes to ask for with `--sbatch` (inside an allocation: its nodes)", 1,
                        ge=1)
    gpus_per_node: int | None = _field(
        "GPUs per node (default: from the allocation, SLURM_GPUS_PER_NODE / "
        "SLURM_GPUS_ON_NODE; 0 without)", None, ge=0)
    engine_nodes: int = _field(
        "roles left out of [roles] are placed by rule: engines on the first engine_nodes nodes, "
        "trainer ranks on the rest, the other roles on node0; 0: every role on node0", 0, ge=0)
    agent_workers: int = _field("agent workers on node0 when [roles.agent_worker] is left out",
                                2, ge=1)
    reward_workers: int = _field(
        "reward workers on node0 when [roles.reward_worker] is left out", 1, ge=1)
    python: str = _field("Python interpreter on the nodes (relative: to workdir)", "python3")
    workdir: str | None = _field(
        "directory the steps start in, on the shared filesystem (default: the launcher's)", None)
    env: dict[str, str] = _field("extra environment variables for every step", factory=dict)
    srun_options: list[str] = _field(
        "extra srun options for every step, e.g. \"--cpus-per-task=4\"", factory=list)
    partition: str | None = _field("`--sbatch`: the partition (default: the cluster's)", None)
    account: str | None = _field("`--sbatch`: the account to charge", None)
    time: str | None = _field("`--sbatch`: the time limit, e.g. \"24:00:00\"", None)
    sbatch_options: list[str] = _field(
        "`--sbatch`: extra sbatch options, e.g. \"--qos=high\"", factory=list)


@dataclass(kw_only=True)
class ClusterConfig:
    name: str = _field("run name (the run directory is <run_dir>/<name>)")
    experiment: str = _field(
        "experiment file, relative to this file's folder (stored resolved, as an absolute path)"
    )
    run_dir: str = _field(
        "directory for logs, checkpoints and state (relative to the working directory)", "runs"
    )
    launcher_address: str | None = _field(
        "address other hosts reach the launching machine at (status hub, control); default: "
        "this machine's host name. Unused when every host is this machine",
        None,
    )
    hosts: dict[str, HostConfig] = _field("machines, by name", factory=dict)
    roles: RolesConfig = _field("where each role runs")
    ports: PortsConfig = _field("port plan", factory=PortsConfig)
    share_gpus: bool = _field(
        "let an engine and trainer ranks use the same GPUs (one GPU for both; the experiment's "
        "sync.backend must then be gloo: NCCL refuses two ranks on one device)", False
    )
    slurm: SlurmConfig | None = _field(
        "run inside a Slurm allocation: hosts from it, processes as job steps (see below)", None
    )
    launcher_cpus: str | None = _field(
        "CPUs of the launching machine the launcher itself may use (a cpulist, \"0-1\"); the "
        "processes it starts there without `cpus` of their own keep the launcher's affinity from "
        "before. Unset: not pinned",
        None,
    )
    # Derived: filled by load_cluster, never read from the file, not compared or written out.
    experiment_config: ExperimentConfig | None = field(
        default=None,
        init=False,
        compare=False,
        repr=False,
        metadata={"help": "the loaded experiment (set by load_cluster)"},
    )

    def processes(self) -> list[Process]:
        """Every process to start, in role order, with its GPUs and ports."""
        per = self.ports.per_process
        cursor = self.ports.base + per  # block 0 is the launcher's
        plan = []
        for role in ROLES:
            explicit = getattr(self.ports, role)
            index = 0
            for p in getattr(self.roles, role):
                k = len(p.gpus) // p.count
                for j in range(p.count):
                    if explicit is not None:
                        port = explicit + index * per
                    else:
                        port, cursor = cursor, cursor + per
                    plan.append(
                        Process(role, index, p.host, tuple(p.gpus[j * k : (j + 1) * k]), port,
                                p.cpus_of(j))
                    )
                    index += 1
        return plan

    @property
    def launcher_port(self) -> int:
        """First of the launcher's own ports (status hub)."""
        return self.ports.base

    def validate(self) -> None:
        for role in ROLES:
            placements = getattr(self.roles, role)
            for i, p in enumerate(placements):
                key = f"roles.{_placement_key(role, i, len(placements))}"
                if p.host not in self.hosts:
                    names = ", ".join(repr(h) for h in self.hosts) or "none defined"
                    raise _Invalid(
                        f"{key}.host",
                        f"expected a name from [hosts] ({names}), got {_show(p.host)}",
                    )
                n = self.hosts[p.host].gpus
                if p.gpus and n == 0:
                    raise _Invalid(
                        f"{key}.gpus",
                        f"expected [] (host {p.host!r} has no GPUs), got {_show(p.gpus)}",
                    )
                for g, gpu in enumerate(p.gpus):
                    if gpu >= n:
                        raise _Invalid(
                            f"{key}.gpus[{g}]",
                            f"expected int in [0, {n}) "
                            f"(host {p.host!r} has {_plural(n, 'GPU')}), got {gpu}",
                        )
                if role == "trainer" and len(p.gpus) > p.count:
                    raise _Invalid(
                        f"{key}.gpus",
                        f"expected at most {_plural(p.count, 'GPU id')} (one per rank), "
                        f"got {_show(p.gpus)}",
                    )
        if self.launcher_cpus is not None:
            _check_cpulist("launcher_cpus", self.launcher_cpus)
        self._check_gpus_given_once()
        self._check_ports()

    def _check_gpus_given_once(self) -> None:
        # Keyed by address: two host entries for one machine share its GPUs.
        owner: dict[tuple[str, int], str] = {}
        for proc in self.processes():
            placements = getattr(self.roles, proc.role)
            i, first = _placement_of(placements, proc.index)
            for g, gpu in enumerate(proc.gpus):
                slot = (self.hosts[proc.host].address, gpu)
                if self.share_gpus and proc.role in ("engine", "trainer"):
                    # colocated: one engine and one trainer rank per GPU, never two of a role
                    slot = (*slot, proc.role)
                if slot in owner:
                    # Its position in the placement's `gpus` list, for the key path.
                    k = len(proc.gpus) * (proc.index - first) + g
                    raise _Invalid(
                        f"roles.{_placement_key(proc.role, i, len(placements))}.gpus[{k}]",
                        f"GPU {gpu} on host {proc.host!r} is given to both {owner[slot]} "
                        f"and {proc.name}",
                    )
                owner[slot] = proc.name

    def _check_ports(self) -> None:
        per = self.ports.per_process

        def key_of(role: str | None) -> str | None:
            return f"ports.{role}" if role and getattr(self.ports, role) is not None else None

        # The launcher's block is reserved on every address: it may run on any of the hosts.
        launcher = range(self.ports.base, self.ports.base + per)
        if launcher[-1] > 65535:
            raise _Invalid(
                "ports.base",
                f"the launcher would get ports {launcher[0]}-{launcher[-1]}, past 65535",
            )
        taken: dict[tuple[str, int], Process] = {}
        for proc in self.processes():
            last = proc.port + per - 1
            if last > 65535:
                raise _Invalid(
                    key_of(proc.role) or "ports.base",
                    f"{proc.name} would get ports {proc.port}-{last}, past 65535",
                )
            address = self.hosts[proc.host].address
            for port in range(proc.port, last + 1):
                other = taken.get((address, port))
                if port in launcher or other is not None:
                    # Automatic blocks never overlap each other: blame the explicit port.
                    key = key_of(proc.role) or key_of(other and other.role) or "ports.base"
                    who = other.name if other else "the launcher"
                    raise _Invalid(
                        key, f"port {port} on {address} is taken by both {who} and {proc.name}"
                    )
                taken[(address, port)] = proc


def _check_registered(key: str, name: str, group: str, *, builtin: Iterable[str] = (),
                      extra: str = "") -> None:
    """A plug-in name must be registered (an entry point of `group`) or built in: a typo fails
    here, at load, not in every worker once the run has started."""
    known = sorted({*builtin, *(ep.name for ep in importlib.metadata.entry_points(group=group))})
    if name not in known:
        hint = _did_you_mean(name, known)
        raise _Invalid(
            key,
            f"expected one of {', '.join(map(repr, known)) or 'nothing (none registered)'} "
            f"({'built in, or ' if builtin else ''}entry points in group '{group}'){extra}, "
            f"got {name!r}"
            + (f" ({hint.strip()})" if hint else ""),
        )


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`did you mean 'x'? ` for a near miss (a typo), else nothing."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.8)
    return f"did you mean {close[0]!r}? " if close else ""


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith("s") else f"{n} {noun}s"


def _placement_key(role: str, i: int, n: int) -> str:
    # A lone placement is usually written as a plain [roles.<role>] table: name it that way.
    return role if n == 1 else f"{role}[{i}]"


def _placement_of(placements: list[Placement], index: int) -> tuple[int, int]:
    """(placement number, index of its first process) for the process numbered `index`."""
    first = 0
    for i, p in enumerate(placements):
        if index < first + p.count:
            return i, first
        first += p.count
    raise IndexError(index)


# ---------------------------------------------------------------------------------------------
# The generic validator
# ---------------------------------------------------------------------------------------------

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_str(key)


def _join(path: str, key: str) -> str:
    return f"{path}.{_key(key)}" if path else _key(key)


def _show(value: Any) -> str:
    """A value as the user wrote it (TOML-like), shortened: for `got ...`."""
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        text = repr(value)
    elif isinstance(value, float):
        text = _toml_float(value)
    elif isinstance(value, list):
        text = "[" + ", ".join(_show(v) for v in value) + "]"
    elif isinstance(value, dict):
        return "a table"
    else:
        text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _num(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else repr(bound)


def _bounds(meta: Mapping[str, Any]) -> str:
    lo = ("[", meta["ge"]) if "ge" in meta else ("(", meta["gt"]) if "gt" in meta else None
    hi = ("]", meta["le"]) if "le" in meta else (")", meta["lt"]) if "lt" in meta else None
    if lo and hi:
        return f" in {lo[0]}{_num(lo[1])}, {_num(hi[1])}{hi[0]}"
    if lo:
        return f" {'>=' if lo[0] == '[' else '>'} {_num(lo[1])}"
    if hi:
        return f" {'<=' if hi[0] == ']' else '<'} {_num(hi[1])}"
    return ""


def _optional_of(tp: Any) -> Any | None:
    """X for `X | None` (`X | Y` for `X | Y | None`), else None."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == len(get_args(tp)):
            return None  # a plain `X | Y`: not optional
        return args[0] if len(args) == 1 else Union[tuple(args)]
    return None


def _union_of(tp: Any) -> tuple[Any, ...]:
    """The members of a plain `X | Y` (scalars and lists only: told apart by the value's
    shape), else ()."""
    if get_origin(tp) not in (Union, types.UnionType):
        return ()
    members = get_args(tp)
    assert all(m in (str, int, float, bool) or get_origin(m) is list for m in members), (
        f"only unions of scalars and lists are supported, not {tp}")
    return members


def _shape_fits(tp: Any, value: Any) -> bool:
    if get_origin(tp) is list:
        return isinstance(value, list)
    if tp is bool or isinstance(value, bool):
        return tp is bool and isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float))
    return isinstance(value, tp)


def _describe(tp: Any, meta: Mapping[str, Any] = types.MappingProxyType({})) -> str:
    """What a value of type `tp` must be, as in `expected <this>`."""
    inner = _optional_of(tp)
    if inner is not None:
        return _describe(inner, meta)  # TOML has no null: None is written by leaving the key out
    members = _union_of(tp)
    if members:
        return " or ".join(_describe(m, meta) for m in members)
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return "a table"
    if origin is list:
        (item,) = get_args(tp)
        if dataclasses.is_dataclass(item):
            return "a table or a list of tables"
        return f"a list of {_describe(item, meta)}"
    if origin is dict:
        value = get_args(tp)[1]
        return (
            "a table of tables"
            if dataclasses.is_dataclass(value)
            else f"a table of {_describe(value, meta)}"
        )
    if origin is Literal:
        return "one of " + ", ".join(repr(c) for c in get_args(tp))
    return tp.__name__ + (_bounds(meta) if tp in (int, float) else "")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


class _Context:
    """Where values came from: the file, or (for key paths below an override) a `--set`."""

    def __init__(
        self,
        source: str,
        origins: Mapping[str, str] | None = None,
        raw: Mapping[str, str] | None = None,
    ) -> None:
        self.source = source
        self.origins = dict(origins or {})  # key path -> "--set ..." that set (or created) it
        self.raw = dict(raw or {})  # key path -> an override's value text, before TOML parsing

    def source_of(self, path: str) -> str:
        best = ""
        for key in self.origins:
            if (path == key or path.startswith((key + ".", key + "["))) and len(key) > len(best):
                best = key
        return self.origins[best] if best else self.source

    def fail(self, path: str, problem: str) -> NoReturn:
        raise ConfigError(self.source_of(path), path, problem)


def _convert(tp: Any, meta: Mapping[str, Any], value: Any, path: str, ctx: _Context) -> Any:
    inner = _optional_of(tp)
    if inner is not None:
        return None if value is None else _convert(inner, meta, value, path, ctx)
    members = _union_of(tp)
    if members:
        if str in members and path in ctx.raw and not isinstance(value, (str, list, dict)):
            value = ctx.raw[path]  # `--set roles.trainer.cpus=1`: the text as typed
        fits = [m for m in members if _shape_fits(m, value)]
        if not fits:
            ctx.fail(path, f"expected {_describe(tp, meta)}, got {_show(value)}")
        return _convert(fits[0], meta, value, path, ctx)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            ctx.fail(path, f"expected a table, got {_show(value)}")
        return _parse_dataclass(tp, value, path, ctx)
    origin = get_origin(tp)
    if origin is list:
        (item,) = get_args(tp)
        if dataclasses.is_dataclass(item) and isinstance(value, dict):
            return [_parse_dataclass(item, value, path, ctx)]  # [t] stands for a one-item [[t]]
        if not isinstance(value, list):
            ctx.fail(path, f"expected {_describe(tp, meta)}, got {_show(value)}")
        return [_convert(item, meta, v, f"{path}[{i}]", ctx) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            ctx.fail(path, f"expected {_describe(tp, meta)}, got {_show(value)}")
        value_tp = get_args(tp)[1]
        return {k: _convert(value_tp, meta, v, _join(path, k), ctx) for k, v in value.items()}
    if origin is Literal:
        if not any(type(value) is type(c) and value == c for c in get_args(tp)):
            ctx.fail(path, f"expected {_describe(tp)}, got {_show(value)}")
        return value
    if tp is str and path in ctx.raw and not isinstance(value, (str, list, dict)):
        # `--set name=2024-01-01` parses as a TOML date; a str field wants the text as typed.
        value = ctx.raw[path]
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),  # TOML keeps true and 1 apart
        float: isinstance(value, (int, float))
        and not isinstance(value, bool)
        and not math.isnan(value),
        str: isinstance(value, str),
    }[tp]
    if ok and tp in (int, float):
        ok = _in_bounds(value, meta)
    if not ok:
        ctx.fail(path, f"expected {_describe(tp, meta)}, got {_show(value)}")
    return float(value) if tp is float else value


def _in_bounds(v: float, meta: Mapping[str, Any]) -> bool:
    return (
        ("ge" not in meta or v >= meta["ge"])
        and ("gt" not in meta or v > meta["gt"])
        and ("le" not in meta or v <= meta["le"])
        and ("lt" not in meta or v < meta["lt"])
    )


def _parse_dataclass(cls: type, data: Mapping[str, Any], path: str, ctx: _Context) -> Any:
    hints = _hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = [f.name for f in fields]
    for key in data:
        if key not in names:
            ctx.fail(_join(path, key), f"unknown key ({_did_you_mean(key, names)}expected one of: "
                     f"{', '.join(names)})")
    values = {}
    for f in fields:
        key = _join(path, f.name)
        if f.name in data:
            values[f.name] = _convert(hints[f.name], f.metadata, data[f.name], key, ctx)
        elif dataclasses.is_dataclass(hints[f.name]):
            # A missing section is an empty one: its defaults, or its own missing-value errors.
            values[f.name] = _parse_dataclass(hints[f.name], {}, key, ctx)
        elif f.default is MISSING and f.default_factory is MISSING:
            ctx.fail(
                key, f"missing required value (expected {_describe(hints[f.name], f.metadata)})"
            )
    obj = cls(**values)
    if hasattr(obj, "validate"):
        try:
            obj.validate()
        except _Invalid as e:
            ctx.fail(f"{path}.{e.key}" if path else e.key, e.problem)  # e.key is a path already
    return obj


def parse_config(cls: type, data: Mapping[str, Any], source: str) -> Any:
    """Validate a plain dict (from a TOML file, or a spec received over the wire) into `cls`.

    `None` is accepted for `X | None` fields. Raises ConfigError naming `source`."""
    return _parse(cls, data, _Context(source))


def _parse(cls: type, data: Any, ctx: _Context) -> Any:
    if not isinstance(data, dict):
        ctx.fail("", f"expected a table, got {_show(data)}")
    return _parse_dataclass(cls, data, "", ctx)


# ---------------------------------------------------------------------------------------------
# Files and overrides
# ---------------------------------------------------------------------------------------------


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(path, "", "file not found") from None
    except OSError as e:
        raise ConfigError(path, "", f"cannot read ({e.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(path, "", f"invalid TOML: {e}") from None


def _parse_override(text: str) -> tuple[list[str], Any]:
    source = f"--set {text}"
    key, eq, raw = text.partition("=")
    key = key.strip()
    if not eq or not key:
        raise ConfigError(source, "", "expected section.key=value")
    invalid = ConfigError(
        source, "", f"invalid key {key!r} (expected dotted keys, e.g. rollout.top_p)"
    )
    try:
        # TOML's own dotted-key grammar, so quoted keys ("my.host") work as in a file.
        doc: Any = tomllib.loads(f"{key} = 0")
    except tomllib.TOMLDecodeError:
        raise invalid from None
    parts = []
    while isinstance(doc, dict):
        if len(doc) != 1:  # e.g. a newline in the key made two assignments
            raise invalid
        ((name, doc),) = doc.items()
        parts.append(name)
    try:
        parsed = tomllib.loads(f"v = {raw}")
        value = parsed["v"] if parsed.keys() == {"v"} else raw
    except tomllib.TOMLDecodeError:
        value = raw  # not a TOML value: a bare string, so `--set model.path=/m/x` needs no quotes
    return parts, value


def _merge_overrides(
    data: Mapping[str, Any], overrides: Iterable[str], source: str
) -> tuple[dict[str, Any], _Context]:
    """(data with the overrides applied, a context that knows which key paths they set)."""
    merged = copy.deepcopy(dict(data))
    origins: dict[str, str] = {}
    raw: dict[str, str] = {}
    for text in overrides:
        parts, value = _parse_override(text)
        origin = f"--set {text}"
        table, path = merged, ""
        for name in parts[:-1]:
            path = _join(path, name)
            if name not in table:
                # What is missing from a table the override created is both the file's and its.
                table[name] = {}
                origins.setdefault(path, f"{source} (with {origin})")
            elif not isinstance(table[name], dict):
                raise ConfigError(
                    origin,
                    path,
                    f"cannot set a key inside {_show(table[name])} in {source} (not a table)",
                )
            table = table[name]
        table[parts[-1]] = value
        path = _join(path, parts[-1])
        origins[path] = origin
        raw[path] = text.partition("=")[2]
        # A later override of the same key wins; forget origins below it from earlier ones.
        for key in [k for k in origins if k.startswith(path + ".") and origins[k] != origin]:
            del origins[key]
    return merged, _Context(source, origins, raw)


def apply_overrides(
    data: Mapping[str, Any], overrides: Iterable[str], source: str
) -> dict[str, Any]:
    """A copy of `data` (read from `source`) with `section.key=value` overrides applied.

    The value is parsed as a TOML value (`2`, `true`, `"a"`, `[1, 2]`); anything that does not
    parse is taken as a bare string. Validation happens when the result is parsed."""
    merged, _ = _merge_overrides(data, overrides, source)
    return merged


def load_experiment(
    path: str | os.PathLike[str], overrides: Iterable[str] = ()
) -> ExperimentConfig:
    """Read, override and validate an experiment file."""
    source = os.fspath(path)
    data, ctx = _merge_overrides(_read_toml(source), overrides, source)
    return _parse(ExperimentConfig, data, ctx)


def load_cluster(path: str | os.PathLike[str], overrides: Iterable[str] = ()) -> ClusterConfig:
    """Read and validate a cluster file and the experiment it names (`.experiment_config`).

    An override goes to the cluster file if its first key is a cluster key (name, experiment,
    run_dir, hosts, roles, ports), otherwise to the experiment (e.g. `staleness.max_staleness=0`).
    """
    source = os.fspath(path)
    cluster_keys = {f.name for f in dataclasses.fields(ClusterConfig) if f.init}
    mine, theirs = [], []
    for text in overrides:
        first = _parse_override(text)[0][0]
        (mine if first in cluster_keys else theirs).append(text)
    data, ctx = _merge_overrides(_read_toml(source), mine, source)
    if "slurm" in data or data.get("hosts") == "slurm":
        from rollmesh.slurm import fill_cluster  # hosts and roles from the allocation

        data = fill_cluster(data, ctx, source, theirs)
    cluster: ClusterConfig = _parse(ClusterConfig, data, ctx)
    cluster.experiment = os.path.abspath(os.path.join(os.path.dirname(source), cluster.experiment))
    if not os.path.isfile(cluster.experiment):
        ctx.fail("experiment", f"expected an existing file, got {_show(cluster.experiment)}")
    exp = load_experiment(cluster.experiment, theirs)
    _check_against_experiment(cluster, exp, ctx)
    _check_local_cpus(cluster, ctx)
    cluster.experiment_config = exp
    return cluster


def _check_against_experiment(cluster: ClusterConfig, exp: ExperimentConfig, ctx: _Context) -> None:
    """The experiment's process counts are the cluster's: they must agree."""
    for role, wanted, what in (
        ("engine", exp.engine.count, "engine.count"),
        ("trainer", exp.trainer.ranks, "trainer.ranks"),
    ):
        placed = sum(p.count for p in getattr(cluster.roles, role))
        if placed != wanted:
            ctx.fail(
                f"roles.{role}",
                f"expected {_plural(wanted, 'process')} in all ({what} in "
                f"{cluster.experiment}), got {placed}",
            )
    _check_local_model(cluster, exp)
    if cluster.share_gpus and exp.sync.backend != "gloo":
        # 'auto' would pick nccl for a CUDA trainer
        ctx.fail("share_gpus", f"expected sync.backend = 'gloo' in {cluster.experiment} "
                               f"(NCCL refuses two ranks on one GPU), got {exp.sync.backend!r}")
    if exp.engine.kind == "sglang":
        placements = cluster.roles.engine
        for i, p in enumerate(placements):
            if len(p.gpus) != p.count * exp.engine.tp_size:
                ctx.fail(
                    f"roles.{_placement_key('engine', i, len(placements))}.gpus",
                    f"expected {_plural(p.count * exp.engine.tp_size, 'GPU id')} (count x "
                    f"engine.tp_size: SGLang runs on GPUs), got {_show(p.gpus)}",
                )


def _check_local_cpus(cluster: ClusterConfig, ctx: _Context) -> None:
    """`cpus` on a host that is this machine (and `launcher_cpus`, unless the launcher runs in a
    Slurm allocation) must name CPUs it has, now; SSH hosts and Slurm nodes are checked by each
    process as it starts (rollmesh.cpus)."""
    from rollmesh.cpus import available_cpus, missing_problem, supported
    from rollmesh.hosts import is_local_address  # hosts imports this module

    checks: list[tuple[str, str, str]] = []  # key, where, cpulist
    if cluster.launcher_cpus is not None and cluster.slurm is None:
        checks.append(("launcher_cpus", "this machine", cluster.launcher_cpus))
    for role in ROLES:
        placements = getattr(cluster.roles, role)
        for i, p in enumerate(placements):
            host = cluster.hosts[p.host]
            local = host.launch == "local" or (host.launch == "auto"
                                               and is_local_address(host.address))
            if p.cpus is None or not local:
                continue
            key = f"roles.{_placement_key(role, i, len(placements))}.cpus"
            where = f"host {p.host!r} ({host.address}, this machine)"
            if isinstance(p.cpus, list):
                checks += [(f"{key}[{j}]", where, text) for j, text in enumerate(p.cpus)]
            else:
                checks.append((key, where, p.cpus))
    if not checks:
        return
    if not supported():
        ctx.fail(checks[0][0], "CPU placement needs Linux (sched_setaffinity)")
    available = available_cpus()
    for key, where, text in checks:
        problem = missing_problem(parse_cpulist(text), available, where)
        if problem:
            ctx.fail(key, f"{problem}, got {_show(text)}")


def _check_local_model(cluster: ClusterConfig, exp: ExperimentConfig) -> None:
    """A model directory that an engine or trainer on this machine would load must exist now,
    not fail in the engine's log after the launch (remote hosts are not checked from here)."""
    path = exp.model.path
    if path == "tiny" or path.startswith("tiny:"):
        return
    from rollmesh.hosts import is_local_address  # hosts imports this module

    for role in ("engine", "trainer"):
        for p in getattr(cluster.roles, role):
            host = cluster.hosts[p.host]
            local = host.launch in ("local", "slurm") or (  # slurm: a shared filesystem
                host.launch == "auto" and is_local_address(host.address)
            )
            full = os.path.join(host.workdir or ".", os.path.expanduser(path))
            if local and not os.path.isdir(full):
                raise ConfigError(
                    cluster.experiment,
                    "model.path",
                    f"expected 'tiny', 'tiny:<spec>' or an existing model directory (the {role} "
                    f"runs on host {p.host!r}, "
                    f"{'a Slurm node: a shared filesystem' if host.launch == 'slurm' else 'this machine'}"
                    f"), got {_show(path)}" + (
                        f": it is the warm-start's output, run `rollmesh sft "
                        f"{cluster.experiment}` first" if exp.sft.init else ""),
                )


# ---------------------------------------------------------------------------------------------
# Rendering: dicts for the wire and logs, TOML for the resolved config at start
# ---------------------------------------------------------------------------------------------


def to_dict(cfg: Any) -> Any:
    """Plain dicts, lists and scalars (None kept, derived fields left out), e.g. for the wire:
    `parse_config` reads it back."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.init}
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    return cfg


def to_toml(cfg: Any) -> str:
    """The config as a TOML document that `tomllib` reads back to the same config (None omitted)."""
    lines: list[str] = []
    _write_table(to_dict(cfg), [], lines)
    return "\n".join(lines).strip() + "\n"


def _toml_str(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch in "\b\t\n\f\r":
            out.append({"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_float(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return repr(x)  # shortest round-trip form; '1e-06' is valid TOML


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return _toml_float(v)
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # inline only when empty (`env = {}`); others get a [header]
        return (
            "{"
            + ", ".join(f"{_key(k)} = {_toml_value(x)}" for k, x in v.items() if x is not None)
            + "}"
        )
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _is_subtable(v: Any) -> bool:
    """Written under a [header] of its own (empty tables are written inline, `x = {}`)."""
    return (isinstance(v, dict) and bool(v)) or _is_table_array(v)


def _write_table(table: dict[str, Any], path: list[str], lines: list[str]) -> None:
    # Plain keys first: after a [header], every key belongs to that table.
    for k, v in table.items():
        if v is not None and not _is_subtable(v):
            lines.append(f"{_key(k)} = {_toml_value(v)}")
    for k, v in table.items():
        sub = path + [_key(k)]
        if isinstance(v, dict) and v:
            plain = any(x is not None and not _is_subtable(x) for x in v.values())
            # A table holding only tables needs no header of its own ([hosts] before [hosts.a]).
            if plain or not any(_is_subtable(x) for x in v.values()):
                lines.extend(["", f"[{'.'.join(sub)}]"])
            _write_table(v, sub, lines)
        elif _is_table_array(v):
            for item in v:
                lines.extend(["", f"[[{'.'.join(sub)}]]"])
                _write_table(item, sub, lines)


def field_reference(cls: type, prefix: str = "") -> list[dict[str, Any]]:
    """One row per field of `cls`, recursing into sections, `<name>` tables and placements:
    key, expected, default (MISSING if required), help. The README's reference comes from it."""
    rows = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key, tp = _join(prefix, f.name), hints[f.name]
        if f.default is not MISSING:
            default: Any = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            default = MISSING
        if dataclasses.is_dataclass(tp) or dataclasses.is_dataclass(_optional_of(tp)):
            rows.extend(field_reference(_optional_of(tp) or tp, key))
            continue
        rows.append(
            {
                "key": key,
                "expected": _describe(tp, f.metadata),
                "default": default,
                "help": f.metadata["help"],
            }
        )
        inner = get_args(tp)[-1] if get_origin(tp) in (list, dict) else None
        if dataclasses.is_dataclass(inner):
            rows.extend(field_reference(inner, f"{key}.<name>" if get_origin(tp) is dict else key))
    return rows


def reference_markdown() -> str:
    """The configuration reference (README), generated from the dataclasses' `help`."""

    def show(v: Any) -> str:
        if v is MISSING:
            return "required"
        return f"`{json.dumps(v) if not isinstance(v, str) else repr(v)}`"

    out = []
    for title, cls in (("Experiment file (`configs/*.toml`)", ExperimentConfig),
                       ("Cluster file (`launch/*.toml`)", ClusterConfig)):
        out += [f"#### {title}", "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for row in field_reference(cls):
            meaning = row["help"].replace("|", "\\|")
            out.append(f"| `{row['key']}` | {row['expected']} | {show(row['default'])} | {meaning} |")
        out.append("")
    return "\n".join(out)
