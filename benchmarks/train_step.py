"""One trainer step, rollmesh's vs a plain transformers step, on the same sequences.

    # CPU, Qwen2.5-0.5B's shape (random weights), 8 sequences with scaled-down lengths (~10 min
    # on 2 cores, peak ~11 GiB):
    python benchmarks/train_step.py --device cpu --shape 0.5b --json /tmp/train_step_cpu.json
    # one GPU, the real RL lengths (prompt 128-512, responses log-normal, median 300, to 4096):
    python benchmarks/train_step.py --device cuda --shape 0.5b --json /tmp/train_step_gpu.json
    # a smoke run of the script itself (seconds):
    python benchmarks/train_step.py --device cpu --shape small --seqs 8 --rl-prompt 8,16 \\
        --rl-median 16 --rl-max 64 --equal-len 32
    # the same, rollmesh with a config override (any `section.key=value`, repeatable):
    python benchmarks/train_step.py ... --set trainer.micro_batch_tokens=4096

The CPU default is one timed step per variant (--repeats 1, to stay near 10 minutes): on a
shared machine a single step can be off by 2-3x (the load average is printed at the start and
the end); take --repeats 3 or more, on a quiet machine, before trusting a CPU ratio.

What is compared (each variant x batch in its own process, one after the other, never at once):

  rollmesh  `prepare(state, data)` then `update_policy(state, data)` (rollmesh/training/step.py) on
            a state from `build_state`: GRPO advantages, decoupled PPO (algorithm.loss =
            "decoupled_ppo"), old_logprobs = "recompute" (with one mini-batch the trainer takes
            them from its training forward, no separate pass), every other setting the
            config default (trainer.micro_batch_tokens included), then the `--set` overrides.
            float32 master weights; bf16 autocast on CUDA (model.dtype = "bfloat16"), float32 on
            CPU. The batch enters as `BatchData` on the host, as the trainer receives it.
  plain     what a plain transformers user writes: the whole batch right-padded to its longest
            sequence, one `model(input_ids, attention_mask, labels).loss` (transformers'
            causal-LM cross-entropy, labels -100 outside the response tokens), backward,
            `clip_grad_norm_(1.0)` (the HF Trainer's default), torch AdamW (lr 1e-6, the same
            betas and weight decay as rollmesh's), zero_grad. Same dtype as rollmesh's; the
            padded batch is built on the host and copied to the device inside the step.

The two batches (a fixed seed; GRPO groups of --group-size samples of one prompt, rewards 0/1
varying within each group so every advantage is nonzero, engine log-probs on the response
tokens, weight version 0):

  rl        prompts uniform in --rl-prompt, responses log-normal (median --rl-median, sigma
            1.3) clipped to [8, --rl-max], and the longest response of the batch set to
            --rl-max (a batch of RL lengths nearly always has a response that hit the limit:
            the tail is what the padded step pays for);
  equal     every sequence --equal-len tokens (prompt an eighth of it).

What is reported, per variant and batch:

  real tokens/s      the batch's tokens (prompt + response, no padding) / the median step time
                     over --repeats timed steps (after one warm-up step); the goal rows compare
                     rollmesh with plain.
  peak memory        CUDA: torch.cuda.max_memory_allocated over the step (absolute; also above
                     what was allocated at its start). CPU: the process's RSS high-water mark
                     over the step (VmHWM, reset through /proc/self/clear_refs before the step),
                     absolute and above the RSS at the step's start (the model, its gradients
                     freed, the AdamW state: what the process holds between steps).
  aten ops           every aten op call seen by a TorchDispatchMode over one step (a separate
                     step, neither warm-up nor timed; backward's ops included), by name (the top
                     15 in the breakdown) and by phase. On CPU these are the ops a GPU run would
                     launch, with one difference: torch's AdamW and clip_grad_norm_ loop over the
                     parameters one by one on CPU and use foreach kernels on CUDA, in both
                     variants alike. Also reported: the ops on the device (an input on the
                     device: on CPU by the taint rule of host syncs below), the kernel launches
                     of a GPU run; the rest is the host's bookkeeping (cutting the batch, the
                     advantages), which a GPU run does on the host too.
  host syncs         calls that make the host wait for the device's result: `aten._local_scalar_
                     dense` (`.item()`, `float(t)`, `bool(t)`, `if t:`), `aten.equal`, and on
                     CUDA blocking device-to-host copies (`.cpu()`, `.tolist()` go there too).
                     On CUDA only calls on CUDA tensors count (a float() of a host tensor is not
                     a sync). On CPU every tensor is a host tensor, so the count is split by a
                     taint rule: a tensor "would live on the GPU" if it is a model parameter or
                     came out of (or met, in one op: devices must match) an op with such a tensor;
                     the split is reported as device / host-side bookkeeping. Not visible on CPU:
                     a `.cpu()` of a device tensor (a no-op there, never dispatched).
  data-dependent     ops whose output shape depends on the data (nonzero, masked_select, unique,
  shapes             boolean-mask indexing, repeat_interleave without output_size, ...): each
                     is a sync on CUDA as well; counted apart.
  per optimizer step the host syncs (+ data-dependent ops) divided by the optimizer steps the step
                     took (counted with an optimizer step hook); the goal is one.
  MFU (CUDA)         model FLOPs / step time / the GPU's dense bf16 peak (H100 SXM and H200:
                     989 TFLOPS; H100 PCIe 756; others: FLOPs/s only). Model FLOPs, the same for
                     both variants (the useful work, not what each variant spends): 6 x (the
                     parameters less the input embedding, plus the LM head's matmul when tied)
                     x real tokens + attention 6 x layers x hidden x sum(len^2) (causal QK^T
                     and AV, forward and backward: 12 x layers x hidden x sum(len^2) / 2).
                     A separate old-log-prob forward (`--set trainer.mini_batches=2`) is not in
                     it.
  breakdown          rollmesh: prepare vs update_policy (time, peak memory, aten ops, syncs);
                     plain: forward + loss, backward, optimizer. Both: every decoder forward's
                     rows x width (padding included), so the padding each variant computes is
                     visible; and the top ops by self time (torch.profiler over the counted
                     step) with their share, and the share of the step spent outside aten ops
                     (Python, the framework).

Memory safety: before a process starts its rough need is estimated (the static model +
gradients + AdamW, and per token of its largest forward the logits and activations); a variant
that would not fit in the free memory is skipped with the reason printed, and a watchdog kills
a CPU process whose RSS passes --mem-cap-gib (default: the memory available at the start less 3
GiB), reported as such. On CUDA an out-of-memory error is caught and reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.results import row, write  # noqa: E402

GIB = 2**30
SMALL = dict(vocab_size=32768, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
             rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
             use_sliding_window=False)
SIGMA = 1.3  # of the log-normal response lengths: ~2% of the draws beyond 4k at median 300
PEAK_BF16 = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12))
DATA_DEPENDENT = {"nonzero", "nonzero_static", "masked_select", "unique", "_unique", "_unique2",
                  "unique_consecutive", "unique_dim", "argwhere", "masked_scatter",
                  "_assert_async", "repeat_interleave"}
TARGETS = {"rl": {"cpu": 1.5, "cuda": 2.0}, "equal": {"cpu": 0.9, "cuda": 0.9}}
MEM_CEILING, OPS_CEILING = 0.6, 1.1


def shape_config(shape: str) -> dict[str, Any]:
    if shape == "small":
        return dict(SMALL)
    from benchmarks.real_scale import QWEN25_05B

    return dict(QWEN25_05B)


# -- the checkpoint and the batches ----------------------------------------------------------------


def write_checkpoint(path: Path, shape: str) -> Path:
    """The shape's config with random bfloat16 weights (N(0, 0.02); norms 1) and the tiny
    tokenizer, once (real_scale's writer; 0.5b: real_scale's checkpoint, the same files)."""
    from benchmarks.real_scale import write_checkpoint as write

    return write(path, shape_config(shape))


def lengths(kind: str, seqs: int, group_size: int, rl_prompt: tuple[int, int], rl_median: int,
            rl_max: int, equal_len: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt tokens, response tokens) of each sequence; one prompt length per group."""
    import numpy as np

    if kind == "equal":
        prompt = max(1, equal_len // 8)
        return [(prompt, equal_len - prompt)] * seqs
    rng = np.random.default_rng(seed)
    groups = -(-seqs // group_size)
    prompts = rng.integers(rl_prompt[0], rl_prompt[1] + 1, groups)
    responses = np.clip(np.round(rl_median * np.exp(SIGMA * rng.standard_normal(seqs))), 8,
                        rl_max).astype(int)
    responses[int(np.argmax(responses))] = rl_max
    return [(int(prompts[i // group_size]), int(responses[i])) for i in range(seqs)]


def make_batch(lens: list[tuple[int, int]], group_size: int, vocab: int, seed: int = 0) -> Any:
    """The sequences as rollmesh Groups (what the trainer receives), then `from_groups`."""
    import numpy as np

    from rollmesh.training.batching import from_groups
    from rollmesh.wire.messages import Group, Trajectory

    rng = np.random.default_rng(seed)
    high = min(vocab, 30000)
    groups = []
    for g in range(-(-len(lens) // group_size)):
        members = lens[g * group_size:(g + 1) * group_size]
        prompt = rng.integers(3, high, members[0][0])
        rewards = (rng.random(len(members)) < 0.5).astype(float)
        rewards[0], rewards[-1] = 1.0, 0.0  # varying within the group: nonzero advantages
        trajs = []
        for i, (p, r) in enumerate(members):
            ids = np.concatenate([prompt[:p], rng.integers(3, high, r)]).astype(np.int32)
            mask = (np.arange(p + r) >= p).astype(np.uint8)
            trajs.append(Trajectory(
                sample_id=f"g{g}-{i}", group_id=f"g{g}", token_ids=ids,
                logprobs=(-rng.uniform(0.5, 5.0, p + r) * mask).astype(np.float32),
                versions=np.where(mask == 1, 0, -1).astype(np.int32), loss_mask=mask,
                prompt_len=p, index=i, status="finished",
                finish_reason="length" if i == 0 and r == max(x[1] for x in lens) else "stop",
                reward=float(rewards[i]), reward_status="ok"))
        groups.append(Group(group_id=f"g{g}", trajectories=trajs))
    return from_groups(groups)


def experiment(path: Path, device: str, group_size: int, max_len: int, max_new: int,
               overrides: list[str]) -> Any:
    """GRPO + decoupled PPO, old_logprobs "recompute", the trainer's defaults otherwise."""
    from rollmesh.config import ExperimentConfig, apply_overrides, parse_config

    base = {"seed": 1,
            "model": {"path": str(path), "dtype": "bfloat16" if device == "cuda" else "float32",
                      "max_context": max(2048, max_len)},
            "data": {"train_path": "unused.jsonl", "format": "jsonl", "group_size": group_size},
            "rollout": {"max_new_tokens": max_new, "batch_groups": 1, "temperature": 1.0},
            "algorithm": {"advantage": "grpo", "loss": "decoupled_ppo",
                          "old_logprobs": "recompute"},
            "trainer": {"lr": 1e-6, "warmup_steps": 0, "lr_schedule": "constant",
                        "total_steps": 1000, "device": device},
            "sync": {"backend": "gloo"}}
    return parse_config(ExperimentConfig, apply_overrides(base, overrides, "train_step"),
                        "train_step")


# -- counting: aten ops and host synchronisations --------------------------------------------------


class OpCounter:
    """A TorchDispatchMode (built lazily: `mode()`) that counts aten op calls by name and phase,
    host synchronisations and data-dependent-shape ops. See the module docstring for the rules.

    device "cuda": a sync is `_local_scalar_dense`/`equal` on a CUDA tensor or a blocking CUDA ->
    host copy. device "cpu": every `_local_scalar_dense`/`equal` counts, split into "device"
    (the tensor is tainted: a model parameter, or produced by / met in one op a tainted
    tensor; 0-dim tensors are not tainted by meeting one, as a CPU scalar may meet a CUDA
    tensor) and "host" (bookkeeping that stays on the host in a GPU run)."""

    def __init__(self, device: str, seeds: list[torch.Tensor] = ()):
        from torch.utils.weak import WeakTensorKeyDictionary

        self.device = device
        self.phase = "step"
        self.ops: Counter[str] = Counter()
        self.device_ops = 0  # ops on tensors that live on the device (a kernel launch on a GPU)
        self.by_phase: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()  # "device", "host", by what: "item", "equal", "d2h"
        self.sync_phase: Counter[str] = Counter()
        self.data_dependent: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()  # where the device syncs come from
        self.paused = False
        self.tainted = WeakTensorKeyDictionary()
        for t in seeds:
            self.tainted[t] = True

    @contextlib.contextmanager
    def host_boundaries(self) -> Any:
        """CPU only: makes the host <-> device boundary of a GPU run visible. `t.to(device)`
        (the step's device) marks its result a device tensor (on CPU it is a no-op that never
        dispatches); `t.cpu()` of a device tensor counts a blocking device-to-host copy and
        returns a host copy (untainted; `.cpu()` never aliases on a GPU); `.tolist()` and
        `.numpy()` of a device tensor count one too."""
        counter, saved = self, {k: getattr(torch.Tensor, k) for k in ("to", "cpu", "tolist",
                                                                      "numpy")}

        def to(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = saved["to"](t, *args, **kwargs)
            dev = kwargs.get("device")
            for a in args:
                if isinstance(a, (str, torch.device)):
                    dev = a
            if dev is not None and isinstance(out, torch.Tensor) and \
                    torch.device(dev).type == counter.device:
                counter.tainted[out] = True
            return out

        def cpu(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if t in counter.tainted:
                counter._sync("d2h", True)
                counter.paused = True
                try:
                    return t.clone()
                finally:
                    counter.paused = False
            return saved["cpu"](t, *args, **kwargs)

        def leave(name: str) -> Any:
            def fn(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if t in counter.tainted:
                    counter._sync("d2h", True)
                return saved[name](t, *args, **kwargs)
            return fn

        if self.device != "cpu":
            yield
            return
        torch.Tensor.to, torch.Tensor.cpu = to, cpu
        torch.Tensor.tolist, torch.Tensor.numpy = leave("tolist"), leave("numpy")
        try:
            yield
        finally:
            for k, v in saved.items():
                setattr(torch.Tensor, k, v)

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def device_syncs(self) -> int:
        return sum(v for k, v in self.syncs.items() if k.startswith("device"))

    def mode(self) -> Any:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                counter.record(func, args, kwargs, out)
                return out

        return Mode()

    def _is_device(self, t: torch.Tensor) -> bool:
        if self.device == "cuda":
            return t.device.type == "cuda"
        return t in self.tainted

    def _sync(self, what: str, on_device: bool) -> None:
        where = "device" if on_device else "host"
        self.syncs[f"{where}:{what}"] += 1
        if on_device:
            self.sync_phase[self.phase] += 1
            self.sites[call_site()] += 1

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        from torch.utils._pytree import tree_flatten

        if self.paused:
            return
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        self.by_phase[self.phase] += 1
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if self.device == "cuda":
            self.device_ops += any(t.device.type == "cuda" for t in inputs + outputs)
        else:
            self.device_ops += any(t in self.tainted for t in inputs)
        if name in ("_local_scalar_dense", "equal"):
            self._sync("item" if name != "equal" else "equal",
                       any(self._is_device(t) for t in inputs))
        elif name in DATA_DEPENDENT and not (name == "repeat_interleave"
                                             and kwargs.get("output_size") is not None):
            self._data_dependent(name, inputs)
        elif name == "index" and any(t.dtype == torch.bool for t in inputs[1:]):
            self._data_dependent("index (boolean mask)", inputs)
        elif self.device == "cuda" and name in ("_to_copy", "copy_"):
            src, dst_cpu = (args[0], kwargs.get("device") is not None
                            and torch.device(kwargs["device"]).type == "cpu") \
                if name == "_to_copy" else (args[1], args[0].device.type == "cpu")
            blocking = not (kwargs.get("non_blocking") or (len(args) > 2 and args[2]))
            if src.device.type == "cuda" and dst_cpu and blocking:
                self._sync("d2h", True)
        if self.device == "cpu" and any(t in self.tainted for t in inputs):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.tainted[t] = True
            for t in inputs:
                if t.dim() > 0:
                    self.tainted[t] = True

    def _data_dependent(self, name: str, inputs: list[torch.Tensor]) -> None:
        on_device = any(self._is_device(t) for t in inputs)
        self.data_dependent[f"{'device' if on_device else 'host'}:{name}"] += 1
        if on_device:
            self.sync_phase[self.phase] += 1
            self.sites[call_site()] += 1

    def device_data_dependent(self) -> int:
        return sum(v for k, v in self.data_dependent.items() if k.startswith("device"))

    def summary(self, optimizer_steps: int) -> dict[str, Any]:
        per_opt = max(optimizer_steps, 1)
        return {"aten_ops": self.total, "device_ops": self.device_ops,
                "ops_by_phase": dict(self.by_phase),
                "top_ops": self.ops.most_common(15), "syncs": dict(self.syncs),
                "device_syncs": self.device_syncs(), "sync_phase": dict(self.sync_phase),
                "data_dependent": dict(self.data_dependent),
                "sync_sites": self.sites.most_common(12),
                "optimizer_steps": optimizer_steps,
                "syncs_per_optimizer_step": (self.device_syncs()
                                             + self.device_data_dependent()) / per_opt}


def call_site() -> str:
    """The innermost caller outside torch and this file: "path:line function"."""
    frame = sys._getframe(1)
    torch_dir = str(Path(torch.__file__).parent)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(torch_dir) or name == __file__ or "/torch/" in name):
            try:
                name = str(Path(name).relative_to(REPO))
            except ValueError:
                pass
            return f"{name}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


@contextlib.contextmanager
def optimizer_steps() -> Any:
    """Counts optimizer.step() calls (any optimizer) inside the block: yields a list, its len."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps: list[int] = []
    handle = register_optimizer_step_post_hook(lambda *a, **k: steps.append(1))
    try:
        yield steps
    finally:
        handle.remove()


# -- memory ----------------------------------------------------------------------------------------


def _status(field: str, pid: str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


class Memory:
    """The step's peak: CUDA max_memory_allocated, or this process's VmHWM (reset by writing 5
    to /proc/self/clear_refs; where that is refused, ru_maxrss since the start)."""

    def __init__(self, device: torch.device):
        self.device = device

    def now(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated()
        return _status("VmRSS")

    def reset(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        else:
            try:
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:
                pass
        return self.now()

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated()
        return max(_status("VmHWM"), 0) or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def estimate_bytes(cfg: dict[str, Any], device: str, forward_tokens: int, widest: int,
                   rows: int) -> int:
    """A rough need of one training step: float32 weights, gradients and AdamW state; per token
    of the largest forward, the logits (the model's dtype, a float32 copy, log-softmax and their
    gradients) and the layers' saved activations; one layer's attention scores."""
    h, v, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    inter, heads = cfg["intermediate_size"], cfg["num_attention_heads"]
    params = v * h + layers * (4 * h * h + 3 * h * inter)
    act = 2 if device == "cuda" else 4
    per_token = v * (act + 4 + 4 + 4) + layers * (16 * h + 4 * inter) * act
    return 16 * params + forward_tokens * per_token + rows * widest * widest * heads * 4 * 2


# -- the measured processes ------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _layer_hook(model: torch.nn.Module, passes: list[dict[str, Any]]) -> Any:
    """Records every decoder forward's rows x width (padding included) and grad mode."""
    layers = None
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, torch.nn.ModuleList) and len(module):
            layers = module
            break
    if layers is None:
        return None

    def hook(_module: Any, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.dim() == 3:
            passes.append({"rows": int(hidden.shape[0]), "width": int(hidden.shape[1]),
                           "grad": torch.is_grad_enabled()})

    return layers[0].register_forward_pre_hook(hook, with_kwargs=True)


def _compute_params(model: torch.nn.Module) -> int:
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    tied = getattr(model.config, "tie_word_embeddings", False)
    return total - emb + (emb if tied else 0)


def _top_self_times(prof: Any, device: torch.device, wall_s: float) -> dict[str, Any]:
    events = prof.key_averages()
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    if device.type == "cuda" and not hasattr(events[0] if len(events) else None, attr):
        attr = "self_cuda_time_total"
    rows = [(e.key, getattr(e, attr, 0.0) / 1e6, e.count) for e in events
            if e.key.startswith("aten::")]
    total = sum(r[1] for r in rows)
    rows.sort(key=lambda r: -r[1])
    return {"measured": "GPU kernel time" if device.type == "cuda" else "CPU self time",
            "total_s": total, "outside_ops_share": max(0.0, 1 - total / wall_s)
            if device.type == "cpu" and wall_s > 0 else None,
            "top": [{"op": k, "s": s, "share": s / total if total else 0.0, "calls": c}
                    for k, s, c in rows[:10]]}


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    """In this process: build the variant, one warm-up step, one counted (and profiled) step,
    --repeats timed steps. The JSON of it is the process's last stdout line."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = shape_config(args.shape)
    lens = lengths(args.batch, args.seqs, args.group_size, args.rl_prompt, args.rl_median,
                   args.rl_max, args.equal_len)
    data = make_batch(lens, args.group_size, cfg["vocab_size"])
    out: dict[str, Any] = {"variant": args.variant, "batch": args.batch,
                           "real_tokens": int(data.lengths.sum()), "seqs": data.size,
                           "width": int(data.tokens.shape[1])}
    start = time.perf_counter()
    if args.variant == "rollmesh":
        from rollmesh.training.state import build_state
        from rollmesh.training.step import prepare, update_policy

        exp = experiment(args.dir, device.type, args.group_size, int(data.tokens.shape[1]),
                         args.rl_max, args.set)
        state = build_state(exp, device=device)
        model = state.model
        out["micro_batch_tokens"] = exp.trainer.micro_batch_tokens

        def step(timer: dict[str, float], counter: OpCounter | None = None) -> Any:
            result: Any = data
            for phase, fn in (("prepare", prepare), ("update_policy", update_policy)):
                if counter is not None:
                    counter.phase = phase
                memory.reset()
                t0 = time.perf_counter()
                result = fn(state, result)
                _sync(device)
                timer[phase] = time.perf_counter() - t0
                timer[phase + "_peak"] = memory.peak()
            return result["loss"]
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            args.dir, dtype=torch.float32, attn_implementation="sdpa").to(device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.999),
                                      weight_decay=0.01)
        host = data.rows(list(range(data.size)))
        host = {"input_ids": host["tokens"], "attention_mask": host["attention_mask"],
                "labels": torch.where(host["mask"] > 0, host["tokens"], -100)}

        def step(timer: dict[str, float], counter: OpCounter | None = None) -> Any:
            def phase(name: str) -> None:
                if counter is not None:
                    counter.phase = name
                memory.reset()

            def done(name: str, t0: float) -> None:
                _sync(device)
                timer[name] = time.perf_counter() - t0
                timer[name + "_peak"] = memory.peak()

            phase("forward+loss")
            t0 = time.perf_counter()
            batch = {k: v.to(device) for k, v in host.items()}
            with torch.autocast(device.type, dtype=torch.bfloat16,
                                enabled=device.type == "cuda"):
                loss = model(**batch).loss
            done("forward+loss", t0)
            phase("backward")
            t0 = time.perf_counter()
            loss.backward()
            done("backward", t0)
            phase("optimizer")
            t0 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done("optimizer", t0)
            return loss.detach()

    out["build_s"] = time.perf_counter() - start
    out["compute_params"] = _compute_params(model)
    memory = Memory(device)
    passes: list[dict[str, Any]] = []
    hook = _layer_hook(model, passes)
    try:
        timer: dict[str, float] = {}
        t0 = time.perf_counter()
        step(timer)  # warm-up: kernels, allocator, the optimizer's state
        _sync(device)
        out["warmup_s"] = time.perf_counter() - t0
        out["passes"] = list(passes)

        # the counted step: its own (the mode's Python work slows every op)
        seeds = [p for p in model.parameters()] if device.type == "cpu" else []
        counter = OpCounter(device.type, seeds)
        with optimizer_steps() as opt_steps, counter.host_boundaries(), counter.mode():
            loss = step({}, counter)
        _sync(device)
        out["counts"] = counter.summary(len(opt_steps))

        # the profiled step (top ops by self time): its own on CUDA (the profiler slows the
        # launches); on CPU the first timed step (its cost is a few us an op: noise there)
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                               if device.type == "cuda" else [])
        if device.type == "cuda":
            with profile(activities=activities) as prof:
                t0 = time.perf_counter()
                step({})
                _sync(device)
            out["profile"] = _top_self_times(prof, device, time.perf_counter() - t0)
            del prof

        times, phases, peaks, above = [], [], [], []
        for i in range(args.repeats):
            timer = {}
            _sync(device)
            profiling = device.type == "cpu" and i == 0
            prof = profile(activities=activities) if profiling else contextlib.nullcontext()
            resident = memory.reset()
            with prof:
                t0 = time.perf_counter()
                loss = step(timer)
                _sync(device)
                times.append(time.perf_counter() - t0)
            if profiling:
                out["profile"] = _top_self_times(prof, device, times[-1])
            peak = max(v for k, v in timer.items() if k.endswith("_peak"))
            phases.append(timer)
            peaks.append(peak)
            above.append(peak - resident)
            out["resident"] = resident
        i = sorted(range(len(times)), key=lambda j: times[j])[len(times) // 2]
        out.update(step_s=statistics.median(times), times=times, phases=phases[i],
                   peak=max(peaks), peak_above=max(above), loss=float(loss),
                   status="ok")
    except torch.cuda.OutOfMemoryError as e:
        out.update(status="oom", reason=str(e).splitlines()[0],
                   peak=torch.cuda.max_memory_allocated())
    finally:
        if hook is not None:
            hook.remove()
    return out


def child(args: argparse.Namespace, variant: str, batch: str, cap: int) -> dict[str, Any]:
    """The variant x batch in its own process; a CPU process whose RSS passes `cap` is killed."""
    cmd = [sys.executable, __file__, "--role", "variant", "--variant", variant, "--batch", batch,
           "--device", args.device, "--shape", args.shape, "--dir", str(args.dir),
           "--seqs", str(args.seqs), "--group-size", str(args.group_size),
           "--rl-prompt", f"{args.rl_prompt[0]},{args.rl_prompt[1]}",
           "--rl-median", str(args.rl_median), "--rl-max", str(args.rl_max),
           "--equal-len", str(args.equal_len), "--repeats", str(args.repeats),
           "--threads", str(args.threads)]
    for s in args.set:
        cmd += ["--set", s]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    killed: list[int] = []

    def watch() -> None:
        while proc.poll() is None:
            try:
                rss = _status("VmRSS", str(proc.pid))
            except (OSError, ValueError):
                return
            if args.device == "cpu" and rss > cap:
                killed.append(rss)
                proc.kill()
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        stdout, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"variant": variant, "batch": batch, "status": "timeout",
                "reason": f"ran past --timeout {args.timeout} s"}
    watcher.join(1)
    if killed:
        return {"variant": variant, "batch": batch, "status": "killed",
                "reason": f"RSS {killed[0] / GIB:.1f} GiB passed the cap {cap / GIB:.1f} GiB"}
    if proc.returncode != 0:
        return {"variant": variant, "batch": batch, "status": "failed",
                "reason": f"exited with {proc.returncode}"}
    return json.loads(stdout.strip().splitlines()[-1])


# -- the parent: runs, table, rows -----------------------------------------------------------------


def flops(cfg: dict[str, Any], compute_params: int, lens: list[tuple[int, int]]) -> float:
    real = sum(p + r for p, r in lens)
    attn = 6 * cfg["num_hidden_layers"] * cfg["hidden_size"] * sum((p + r) ** 2 for p, r in lens)
    return 6 * compute_params * real + attn


def peak_flops(device: str) -> tuple[str, float | None]:
    if device != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name()
    for key, value in PEAK_BF16:
        if key in name:
            return name, value
    return name, None


def padding_of(r: dict[str, Any]) -> str:
    """The decoder forwards of the warm-up step: count, rows x width, tokens computed."""
    if not r.get("passes"):
        return "-"
    parts = []
    for grad in (False, True):
        ps = [p for p in r["passes"] if p["grad"] == grad]
        if ps:
            computed = sum(p["rows"] * p["width"] for p in ps)
            shapes = ", ".join(f"{p['rows']}x{p['width']}" for p in ps[:6])
            more = f", +{len(ps) - 6}" if len(ps) > 6 else ""
            parts.append(f"{'train' if grad else 'no-grad'} {len(ps)} pass(es) [{shapes}{more}] "
                         f"{computed} tokens ({r['real_tokens'] / computed:.0%} real)")
    return "; ".join(parts)


def describe(r: dict[str, Any], device: str) -> list[str]:
    if r.get("status") != "ok":
        return [f"  {r['variant']:8s} {r['status']}: {r.get('reason', '')}"]
    c = r["counts"]
    tps = r["real_tokens"] / r["step_s"]
    mem = "GPU allocated" if device == "cuda" else "RSS"
    lines = [f"  {r['variant']:8s} {tps:9.1f} real tokens/s  step {r['step_s']:7.2f} s "
             f"(times {', '.join(f'{t:.2f}' for t in r['times'])})  peak {mem} "
             f"{r['peak'] / GIB:6.2f} GiB ({r['peak_above'] / GIB:+.2f} over the "
             f"{r['resident'] / GIB:.2f} held between steps)",
             f"           aten ops {c['aten_ops']} (on the device {c['device_ops']})  "
             "host syncs on the device "
             f"{c['device_syncs']}  data-dependent on the device "
             f"{sum(v for k, v in c['data_dependent'].items() if k.startswith('device'))}  "
             f"optimizer steps {c['optimizer_steps']}  -> "
             f"{c['syncs_per_optimizer_step']:.0f} per optimizer step",
             "           phases: " + ", ".join(
                 f"{k} {v:.2f} s (peak {r['phases'][k + '_peak'] / GIB:.2f} GiB, "
                 f"{c['ops_by_phase'].get(k, 0)} ops, {c['sync_phase'].get(k, 0)} syncs)"
                 for k, v in r["phases"].items() if not k.endswith("_peak")),
             f"           syncs by kind: {c['syncs']}; data-dependent: {c['data_dependent']}",
             f"           forwards: {padding_of(r)}",
             "           top ops by count: " + ", ".join(f"{k} {n}" for k, n in c["top_ops"]),
             f"           device syncs from: {c['sync_sites']}",
             f"           top ops by {r['profile']['measured']}: " + ", ".join(
                 f"{t['op'][6:]} {t['share']:.0%}" for t in r["profile"]["top"])]
    if r["profile"].get("outside_ops_share") is not None:
        lines[-1] += f"; outside aten ops {r['profile']['outside_ops_share']:.0%} of the step"
    return lines


def compare(args: argparse.Namespace, batch: str, lens: list[tuple[int, int]],
            ours: dict[str, Any], plain: dict[str, Any], device_name: str,
            peak: float | None) -> list[dict[str, Any]]:
    dev = args.device
    cfg = shape_config(args.shape)
    where = f"{args.shape} shape, {dev}"
    real = ours["real_tokens"]
    width = ours["width"]
    mem = "GPU allocated" if dev == "cuda" else "RSS"
    note = (f"{args.seqs} sequences in groups of {args.group_size}, {real} real tokens, padded "
            f"{args.seqs} x {width} = {args.seqs * width} ("
            + (f"prompts {args.rl_prompt[0]}-{args.rl_prompt[1]}, responses log-normal median "
               f"{args.rl_median} to {args.rl_max}" if batch == "rl" else
               f"every sequence {args.equal_len} tokens")
            + f"); GRPO + decoupled PPO, {'bf16 autocast' if dev == 'cuda' else 'float32'}, "
            f"{args.threads} torch threads, median of {args.repeats}; "
            f"rollmesh micro_batch_tokens {ours.get('micro_batch_tokens')}"
            + (f", --set {' '.join(args.set)}" if args.set else "")
            + f"; device {device_name}")
    base_name = "plain transformers step (padded batch, CE, backward, AdamW)"
    rows = [row(f"train step real tokens/s, {batch} lengths ({where})",
                real / ours["step_s"], real / plain["step_s"], "tokens/s",
                baseline_name=base_name, higher_is_better=True,
                target=TARGETS[batch][dev], note=note),
            row(f"train step peak {mem}, {batch} lengths ({where})", ours["peak"] / GIB,
                plain["peak"] / GIB, "GiB", baseline_name=base_name, higher_is_better=False,
                target=MEM_CEILING if batch == "rl" else None,
                note=note + f"; over what each holds between steps: rollmesh "
                f"{ours['peak_above'] / GIB:.2f} GiB, plain {plain['peak_above'] / GIB:.2f}"),
            row(f"train step aten ops, {batch} lengths ({where})",
                ours["counts"]["aten_ops"], plain["counts"]["aten_ops"], "ops",
                baseline_name=base_name, higher_is_better=False, target=OPS_CEILING,
                note=note + "; counted with a TorchDispatchMode over one step, backward "
                "included; of these on the device (a kernel launch on a GPU; the rest is the "
                f"host's bookkeeping): rollmesh {ours['counts']['device_ops']}, plain "
                f"{plain['counts']['device_ops']}"),
            row(f"train step host syncs per optimizer step, {batch} lengths ({where})",
                ours["counts"]["syncs_per_optimizer_step"], 1.0, "syncs",
                baseline_name="the goal: one per optimizer step (the plain step: "
                f"{plain['counts']['syncs_per_optimizer_step']:g})", higher_is_better=False,
                target=1.0,
                note=note + "; .item()-like calls, blocking device-to-host copies and "
                "data-dependent-shape ops on device tensors (on CPU: on tensors that would live "
                f"on the GPU); rollmesh's by kind: {ours['counts']['syncs']}, data-dependent "
                f"{ours['counts']['data_dependent']}, from {ours['counts']['sync_sites']}")]
    if peak:
        f = flops(cfg, ours["compute_params"], lens)
        rows.append(row(f"train step MFU, {batch} lengths ({where})", f / ours["step_s"] / peak,
                        f / plain["step_s"] / peak, "fraction", baseline_name=base_name,
                        higher_is_better=True,
                        note=note + f"; model FLOPs {f:.3e} (6 x params x real tokens + "
                        f"attention), peak {peak:.3e} FLOP/s bf16 dense"))
    return rows


def main() -> int:
    def pair(s: str) -> tuple[int, int]:
        lo, hi = (int(x) for x in s.split(","))
        return lo, hi

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if cuda else "cpu")
    p.add_argument("--shape", choices=["0.5b", "small"], default="0.5b")
    p.add_argument("--dir", type=Path, default=None,
                   help="checkpoint directory, written once (default: real_scale's for 0.5b)")
    p.add_argument("--seqs", type=int, default=None, help="sequences per batch "
                   "(default: 8 on cuda and on cpu)")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--rl-prompt", type=pair, default=None,
                   help="prompt lengths lo,hi (default: 128,512 on cuda; 16,48 on cpu)")
    p.add_argument("--rl-median", type=int, default=None,
                   help="median response length (default: 300 on cuda; 32 on cpu)")
    p.add_argument("--rl-max", type=int, default=None,
                   help="the longest response (default: 4096 on cuda; 160 on cpu)")
    p.add_argument("--equal-len", type=int, default=None,
                   help="tokens per sequence of the equal batch (default: 1024 on cuda; 64 "
                   "on cpu)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps (default: 5 on "
                   "cuda, 1 on cpu)")
    p.add_argument("--batches", default="rl,equal", type=lambda s: s.split(","))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a rollmesh config override (repeatable), e.g. trainer.packing=false")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mem-cap-gib", type=float, default=None,
                   help="kill a CPU process whose RSS passes this (default: available - 3)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per process")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--role", default=None, help=argparse.SUPPRESS)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--batch", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    on_cuda = args.device == "cuda"
    defaults = dict(seqs=8, rl_prompt=(128, 512) if on_cuda else (16, 48),
                    rl_median=300 if on_cuda else 32, rl_max=4096 if on_cuda else 160,
                    equal_len=1024 if on_cuda else 64, repeats=5 if on_cuda else 1)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.dir is None:
        args.dir = Path("/tmp/rollmesh-qwen25-05b-random" if args.shape == "0.5b"
                        else "/tmp/rollmesh-train-step-small")
    if args.role == "variant":
        print(json.dumps(run_variant(args)), flush=True)
        return 0
    unknown = set(args.batches) - {"rl", "equal"}
    if unknown:
        p.error(f"--batches: unknown {sorted(unknown)} (expected rl, equal)")
    if on_cuda and not cuda:
        p.error("--device cuda: no CUDA device here (use --device cpu)")
    return run(args)


def run(args: argparse.Namespace) -> int:
    started = time.time()
    write_checkpoint(args.dir, args.shape)
    cfg = shape_config(args.shape)
    device_name, peak = peak_flops(args.device)
    cap = int((args.mem_cap_gib * GIB) if args.mem_cap_gib else available() - 3 * GIB)
    print(f"train step: {args.shape} shape, {args.device} ({device_name}), {args.threads} torch "
          f"threads, {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f}, "
          f"{available() / GIB:.1f} GiB available, CPU process cap {cap / GIB:.1f} GiB",
          flush=True)
    rows: list[dict[str, Any]] = []
    results: dict[str, dict[str, Any]] = {}
    for batch in args.batches:
        lens = lengths(batch, args.seqs, args.group_size, args.rl_prompt, args.rl_median,
                       args.rl_max, args.equal_len)
        real = sum(p + r for p, r in lens)
        width = max(p + r for p, r in lens)
        responses = sorted(r for _, r in lens)
        print(f"\n{batch}: {len(lens)} sequences, {real} real tokens, longest {width} "
              f"(padded {len(lens)} x {width} = {len(lens) * width}, {real / (len(lens) * width):.0%}"
              f" real); responses {responses[0]}..{responses[len(responses) // 2]}.."
              f"{responses[-1]}", flush=True)
        got = {}
        for variant in ("plain", "rollmesh"):
            # rollmesh's largest forward is at most the padded batch (rough: its planner may
            # take fewer tokens at once); the static part is the same for both
            need = estimate_bytes(cfg, args.device, len(lens) * width, width, len(lens))
            free = (torch.cuda.mem_get_info()[0] if args.device == "cuda"
                    else min(available(), cap))
            if variant == "plain" and need > free:
                got[variant] = {"variant": variant, "batch": batch, "status": "skipped",
                                "reason": f"needs ~{need / GIB:.1f} GiB (estimate), "
                                f"{free / GIB:.1f} free"}
            else:
                got[variant] = child(args, variant, batch, cap)
            for line in describe(got[variant], args.device):
                print(line, flush=True)
        results[batch] = got
        if all(got[v].get("status") == "ok" for v in got):
            rows += compare(args, batch, lens, got["rollmesh"], got["plain"], device_name, peak)
    print_rows(rows)
    print(f"done in {(time.time() - started) / 60:.1f} min, load average "
          f"{os.getloadavg()[0]:.2f}")
    write(args.json, rows)
    return 0


def print_rows(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    print(f"\n{'figure':72s} {'rollmesh':>10s} {'plain':>10s} {'ratio':>7s} {'target':>7s}")
    for r in rows:
        target = "-" if r["target"] is None else (
            f"{'>=' if r['higher_is_better'] else '<='}{r['target']}")
        met = "" if r["met"] is None else ("  met" if r["met"] else "  MISSED")
        print(f"{r['figure'][:72]:72s} {r['rollmesh']:10.4g} {r['baseline']:10.4g} "
              f"{r['ratio']:7.3f} {target:>7s}{met}")


if __name__ == "__main__":
    raise SystemExit(main())
