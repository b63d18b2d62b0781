"""The experiment file's schema (`configs/*.toml` -> `ExperimentConfig`): one dataclass per
component (model, data, rollout, staleness, algorithm, trainer, sync, engine, metrics, sft), each
field with its help and bounds, and the rules that tie components together (`validate`).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from rollmesh.algorithms.registry import (
    Registry, advantage_estimators, policy_losses, reward_shapings,
)
from rollmesh.config.parse import _did_you_mean, _field, _Invalid, _show

Dtype = Literal["float32", "bfloat16", "float16"]
DistBackend = Literal["auto", "gloo", "nccl"]


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(kw_only=True)
class LoraConfig:
    rank: int = _field(
        "LoRA rank r; 0 = off (full-weight training). On: only the adapters train (peft), the "
        "reference is the base model with the adapters off, and each sync sends the adapters "
        "alone (written to the trainer's lora_dir, loaded by the engines by path: same host or "
        "a shared filesystem)", 0, ge=0)
    alpha: float | None = _field("LoRA alpha (scale alpha / r); none: 2 * rank", None, gt=0)
    dropout: float = _field("dropout on the adapters' input", 0.0, ge=0, lt=1)
    target_modules: list[str] = _field(
        "module names the adapters wrap (peft's target_modules): by default the attention and "
        "MLP projections of Qwen/Llama-class models", factory=lambda: list(LORA_TARGETS))
    use_rslora: bool = _field("rank-stabilised scale alpha / sqrt(r) (peft's use_rslora)", False)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale_alpha(self) -> float:
        return float(self.alpha if self.alpha is not None else 2 * self.rank)

    def validate(self) -> None:
        if self.enabled and not self.target_modules:
            raise _Invalid("target_modules",
                           "expected at least one module name with model.lora.rank > 0, got []")
        bad = [m for m in self.target_modules if not m or not m.replace("_", "").isalnum()]
        if bad:
            raise _Invalid("target_modules",
                           f"expected module names (letters, digits, _), got {bad}")


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
    lora: LoraConfig = _field("LoRA adapters instead of full-weight training",
                              factory=LoraConfig)


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
        "this); where a memory cgroup can be made, the whole call's pages (shared mappings and "
        "its /tmp and /dev/shm files too) are held to this + 64 MiB", 512, ge=32)
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
    allow_unsafe: bool = _field(
        "run model code even where the kernel refuses the network, PID and mount namespaces "
        "(then only an audit hook, which ctypes passes, stands between it and the host's "
        "sockets and processes, and as root it can read any file); otherwise agent workers "
        "fail at start, naming what is missing", False)


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
        "private mappings; contained, where a memory cgroup can be made, all its pages are held "
        "to this + 128 MiB); a function that allocates more fails with reward_status error",
        2048, ge=64)
    reward_allow_unsafe: bool = _field(
        "run reward functions uncontained, as the worker (its user, environment, network and "
        "files); otherwise each runs in new network, PID and mount namespaces with a root of "
        "its own and no capability (as root: a uid of its own), and a reward worker on a host "
        "whose kernel refuses them fails at start, naming what is missing. The `remote` "
        "reward runs in the worker either way (it needs the network)", False)
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
    measure: Literal["admission", "oldest_token"] = _field(
        "where a sample's age is bounded: `admission` (AReaL's rule) bounds the version at which "
        "its generation began, through the rollouter's admission capacity; once admitted it is "
        "trained whatever the versions its tokens span, each token with its own behaviour "
        "log-prob (decoupled_ppo's behaviour_cap guards very old tokens). `oldest_token` drops a "
        "group whose oldest generated token is more than max_staleness versions old, which "
        "drops the longest answers (README, Staleness). sync_mode always measures the oldest "
        "token",
        "admission",
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
        # The baseline is on-policy: nothing generated across a sync may be trained.
        if self.sync_mode:
            self.measure = "oldest_token"

    @property
    def drops_in_flight(self) -> bool:
        """Whether groups are dropped as stale after admission (the `oldest_token` rule)."""
        return self.measure == "oldest_token"

    def validate(self) -> None:
        if self.sync_mode and self.max_staleness != 0:
            raise _Invalid(
                "max_staleness",
                f"expected 0 (or no value) with sync_mode = true (the synchronous on-policy "
                f"baseline), got {self.max_staleness}",
            )


@dataclass(kw_only=True)
class AlgorithmConfig:
    advantage: str = _field(
        "advantage estimator (formulas: README, Algorithms; others register under the "
        "entry-point group `rollmesh.advantage_estimators`)", "grpo",
        choices=advantage_estimators.names)
    loss: str = _field(
        "policy loss: clipped PPO, decoupled PPO (AReaL, for stale samples), truncated "
        "importance sampling, GSPO (one clipped ratio per sequence) or CISPO (the clipped ratio "
        "as a stop-gradient weight of the REINFORCE term); others register under the "
        "entry-point group `rollmesh.policy_losses`",
        "ppo", choices=policy_losses.names)
    reward_shaping: str = _field(
        "how rewards are shaped before the advantage: `default` = reward_scale, the overlong "
        "penalty, reward_clip (the rewards as they are with their defaults); others register "
        "under the entry-point group `rollmesh.reward_shapings`", "default",
        choices=reward_shapings.names)
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
        _check_choice("advantage", self.advantage, advantage_estimators)
        _check_choice("loss", self.loss, policy_losses)
        _check_choice("reward_shaping", self.reward_shaping, reward_shapings)
        critic = self.trains_critic()
        if critic and self.critic_lr is None:
            raise _Invalid(
                "critic_lr",
                f"missing required value (expected float > 0, as advantage = "
                f"'{self.advantage}' trains a critic)",
            )
        if self.kl_coef > 0 and not self.use_reference:
            raise _Invalid(
                "use_reference",
                "expected true when kl_coef > 0 (the KL term needs reference log-probs), got false",
            )
        # (asked only with bypass: a user's loss is then imported here, not at every load)
        if self.old_logprobs == "bypass" and policy_losses.get(self.loss).info.get(
                "needs_behaviour", False):
            # Both corrections compare recomputed and behaviour log-probs: bypass makes them no-ops.
            raise _Invalid(
                "old_logprobs", f"expected 'recompute' with loss = '{self.loss}', got 'bypass'"
            )
        if self.behaviour_cap_mode == "mask" and self.behaviour_cap is None:
            raise _Invalid("behaviour_cap", "missing required value (expected float > 0, as "
                           "behaviour_cap_mode = 'mask' drops tokens above it)")
        if self.bootstrap_truncated and not critic:
            raise _Invalid("bootstrap_truncated", f"expected false with advantage = "
                           f"'{self.advantage}' (only gae has a critic's value to bootstrap "
                           "with), got true")
        if self.bootstrap_truncated and self.mask_truncated:
            raise _Invalid("bootstrap_truncated", "expected false with mask_truncated = true "
                           "(truncated responses are not trained on), got true")


    def trains_critic(self) -> bool:
        """Whether the advantage estimator needs a critic (registered with critic=True: gae)."""
        return bool(advantage_estimators.get(self.advantage).info.get("critic", False))

    def outcome_advantage(self) -> bool:
        """Whether the advantage estimator takes one reward per sequence and compares it within
        its group (registered with outcome=True: grpo, grpo_mean_only, rloo)."""
        return bool(advantage_estimators.get(self.advantage).info.get("outcome", False))


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
        "tokens per forward/backward pass: with packing, real tokens (a longer sequence runs "
        "alone); without, rows x longest row of length-sorted padded rows",
        16384,
        gt=0,
    )
    compile: Literal["auto", "on", "off"] = _field(
        "torch.compile the LM head's chunked log-prob and entropy pass (auto: on CUDA; a "
        "failure to compile falls back to eager)",
        "auto",
    )
    packing: bool = _field(
        "run each micro-batch as one row of its sequences back to back (no padding, attention "
        "confined to each sequence); false: right-padded rows",
        True,
    )
    gradient_checkpointing: bool | str = _field(
        "recompute activations in backward to save memory: true, false, or 'auto' (on when the "
        "trainer runs on CUDA with micro_batch_tokens >= 8192, where activations rather than "
        "weights fill a step's memory; off on CPU)",
        "auto",
    )
    ranks: int = _field("trainer processes (data parallel)", 1, ge=1)
    backend: DistBackend = _field(
        "torch.distributed backend between ranks (auto: nccl on GPU)", "auto"
    )
    checkpoint_every: int = _field("save a checkpoint every N steps (0 = only at the end)", 0, ge=0)
    checkpoint_every_s: float = _field(
        "also save a checkpoint once this many seconds have passed since the last one (0: by "
        "steps only): a power cut or a dead trainer loses at most about this much training",
        300.0, ge=0)
    keep_checkpoints: int = _field(
        "checkpoints kept, the latest ones (older ones are removed once a newer one is whole; "
        "0: all)", 2, ge=0)
    checkpoint_dir: str | None = _field(
        "checkpoint directory (default: <run dir>/checkpoints); with several trainer ranks "
        "every rank writes its own shards there, so it must be on a filesystem all of them see",
        None)
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
    offload_optimizer: bool = _field(
        "colocated mode (cluster file `colocate = true`): keep the optimizer state in host "
        "memory (pinned on a GPU) while the engines generate and bring it back for each step; "
        "frees 2x the fp32 parameters' bytes of device memory for the engines' KV cache, for two "
        "host copies per step. Ignored when not colocated", False)

    def checkpoints_activations(self, device_type: str) -> bool:
        """`gradient_checkpointing` resolved for a trainer on `device_type` ('auto': see the
        field)."""
        if self.gradient_checkpointing == "auto":
            return device_type == "cuda" and self.micro_batch_tokens >= 8192
        return bool(self.gradient_checkpointing)

    def validate(self) -> None:
        if len(self.betas) != 2:
            raise _Invalid("betas", f"expected a list of 2 floats, got {_show(self.betas)}")
        if isinstance(self.gradient_checkpointing, str) and self.gradient_checkpointing != "auto":
            raise _Invalid("gradient_checkpointing", "expected true, false or 'auto', got "
                           f"{self.gradient_checkpointing!r}")
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
    transport: Literal["auto", "broadcast", "handles"] = _field(
        "how the weights reach the engines: `broadcast` = the weight-update group (any host); "
        "`handles` = by handle on the trainer's own host, no socket copy "
        "(/update_weights_from_tensor: shared memory from a CPU trainer, CUDA IPC from a GPU "
        "one; SGLang engines need a GPU trainer); `auto` = handles when every engine URL is "
        "on the trainer's host and the engine kind takes them, else broadcast",
        "auto",
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
    router: Literal["none", "sglang-router"] = _field(
        "a router in front of the engines that generation goes through: `sglang-router` "
        "starts SGLang's (cache-aware: a group's siblings land on the engine holding their "
        "prompt; the `router` extra) beside engine[0]; pause, abort, weight updates and health "
        "stay per engine; none: the agent workers choose the engine (engine.routing)", "none")
    router_policy: Literal["cache_aware", "round_robin", "random", "power_of_two"] = _field(
        "the router's routing policy (`engine.router = \"sglang-router\"`)", "cache_aware")
    routing: Literal["affinity", "least_loaded"] = _field(
        "how agent workers spread /generate requests over the engines: `affinity` = a "
        "trajectory's requests go to its group's engine (rendezvous hashing of the group id, the "
        "same choice in every agent worker), so a GRPO group's siblings and every turn of a "
        "trajectory reuse that engine's prefix cache, unless it has more in flight than "
        "max(1.25 x the mean, the least-loaded engine's + 32) (each worker counting "
        "its own requests), then to the group's next engine; `least_loaded` = each request to "
        "the engine with the fewest in flight (with engine.router, the router chooses)",
        "affinity")
    release_while_training: list[Literal["kv_cache", "weights", "cuda_graph"]] = _field(
        "colocated mode (cluster file `colocate = true`): the memory each engine gives back "
        "while the trainer steps (SGLang's /release_memory_occupation tags); `weights` too "
        "frees the engine's copy of the model, which the sync after the step fills again",
        factory=lambda: ["kv_cache", "cuda_graph"])

    def validate(self) -> None:
        if self.kind == "builtin" and self.tp_size != 1:
            raise _Invalid("tp_size", f"expected 1 for kind = 'builtin', got {self.tp_size}")
        if self.kind == "builtin" and self.extra_args:
            # the engine's own parser, now, rather than a usage line in its log after launch
            from rollmesh.config.engine_args import EngineArgsError, check_builtin_args

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
            if self.algorithm.outcome_advantage():
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
        if self.model.lora.enabled:
            # SGLang binds a running request to its adapter and unloads an adapter only once
            # its requests are done: an adapter cannot change under a running request.
            for key, got, expected, why in (
                    ("sync.pause_mode", self.sync.pause_mode, "abort",
                     "SGLang unloads an adapter only once the requests using it are finished, "
                     "so a sync aborts them (partial rollouts resume under the new adapter)"),
                    ("sync.overlap", self.sync.overlap, False,
                     "an adapter sync moves megabytes; there is nothing to overlap")):
                if got != expected:
                    raise _Invalid(key, f"expected {expected!r} with model.lora.rank > 0 "
                                        f"({why}), got {got!r}")
        if self.sync.sync_every > self.staleness.max_staleness + 1:
            # Just before a sync the trainer is sync_every - 1 versions ahead of the engines.
            raise _Invalid(
                "sync.sync_every",
                f"expected int <= {self.staleness.max_staleness + 1} (staleness.max_staleness + 1, "
                f"or samples go stale before the next sync), got {self.sync.sync_every}",
            )
        if (self.sync.transport == "handles" and self.engine.kind == "sglang"
                and self.trainer.device == "cpu"):
            raise _Invalid(
                "sync.transport",
                "expected broadcast or auto with engine.kind = \"sglang\" and a CPU trainer "
                "(SGLang takes handles only as CUDA IPC, from a GPU trainer), got handles",
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



def _check_choice(key: str, name: str, registry: Registry) -> None:
    """A registry-backed name (policy loss, advantage estimator, reward shaping) must be
    registered: built in or an entry point of the registry's group (listed in that order, as a
    choice of fixed values is)."""
    known = registry.names()
    if name not in known:
        raise _Invalid(key, f"expected one of {', '.join(map(repr, known))}, got {name!r}")


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
