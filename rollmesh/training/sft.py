"""`rollmesh sft`: a supervised warm-start on demonstrations, written as the policy RL starts from.

A random or base model cannot emit a tool call, so an agentic run starts from a policy that
has seen some (users do the same with an SFT stage before RL). This trains the experiment's
`sft.init` checkpoint on `sft.data_path`, a JSONL file of chat transcripts
(`{"messages": [{"role": ..., "content": ...}, ...]}` per line), and writes a Hugging Face
model directory at `model.path`, the checkpoint the RL run of the same config loads.

- Rendering: each transcript through the tokenizer's own chat template, message by message:
  the tokens a message adds are in the loss exactly when it is an assistant message (its
  header, the template's generation prompt, is not). The template must render each prefix of
  the conversation as a prefix of the whole; a row where it does not, or that does not parse,
  is an error naming the file and line.
- Training: the RL trainer's own model, AdamW and schedule (`training.state.build_state`, one
  rank), micro-batches cut by `trainer.micro_batch_tokens` (`training.step.micro_batches`, the
  trainer's own iterator), the token-mean cross-entropy of a whole batch accumulated exactly
  over its micro-batches.
- Output: `checkpoint.export_hf`, the format of a run's `policy/` export, plus `sft.json` (the
  data, steps and the loss per step).

    rollmesh sft CONFIG [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from rollmesh.training import checkpoint
from rollmesh.config import ConfigError, ExperimentConfig, load_experiment
from rollmesh.runtime.log import configure_logging
from rollmesh.training.batching import BatchData
from rollmesh.training.step import micro_batches

__all__ = ["Example", "SftError", "load_transcripts", "main", "render_transcript", "train"]


class SftError(ValueError):
    """Demonstrations or a config that `rollmesh sft` cannot use (the message names which)."""


@dataclasses.dataclass
class Example:
    ids: list[int]
    mask: list[int]  # 1 on assistant tokens (the loss)


def render_transcript(tokenizer: Any, messages: list[dict[str, Any]]) -> Example:
    """Token ids of the conversation as the chat template renders it, with the loss mask:
    each message's own tokens are the difference between the rendering up to it and the
    rendering before it (before an assistant message, with the generation prompt, so its
    header is context, not loss)."""
    ids: list[int] = []
    mask: list[int] = []
    done = ""
    for i, message in enumerate(messages):
        assistant = message.get("role") == "assistant"
        before = (tokenizer.apply_chat_template(messages[:i], tokenize=False,
                                                add_generation_prompt=assistant) if i else "")
        upto = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        if not before.startswith(done) or not upto.startswith(before):
            raise SftError(f"message {i} ({message.get('role')}): the chat template does not "
                           "render this conversation as a continuation of its beginning")
        head = tokenizer.encode(before[len(done):], add_special_tokens=False)
        body = tokenizer.encode(upto[len(before):], add_special_tokens=False)
        ids += head + body
        mask += [0] * len(head) + [int(assistant)] * len(body)
        done = upto
    if not any(mask):
        raise SftError("no assistant message: nothing to learn from")
    return Example(ids, mask)


def load_transcripts(path: str | Path, tokenizer: Any, max_tokens: int) -> list[Example]:
    """Every line of `path` rendered; a bad line is an error naming the file and line."""
    examples = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise SftError(f"sft.data_path: cannot read {path}: {e.strerror or e}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except ValueError as e:
            raise SftError(f"{where}: not JSON: {e}") from None
        messages = row.get("messages") if isinstance(row, dict) else None
        if (not isinstance(messages, list) or not messages
                or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                           for m in messages)):
            raise SftError(f"{where}: expected {{\"messages\": [{{\"role\": ..., "
                           f"\"content\": ...}}, ...]}}")
        try:
            example = render_transcript(tokenizer, messages)
        except SftError as e:
            raise SftError(f"{where}: {e}") from None
        except Exception as e:  # the template raised (jinja's TemplateError, a bad content)
            raise SftError(f"{where}: the chat template cannot render it: "
                           f"{type(e).__name__}: {e}") from None
        if len(example.ids) > max_tokens:
            raise SftError(f"{where}: {len(example.ids)} tokens, more than model.max_context "
                           f"({max_tokens})")
        examples.append(example)
    if not examples:
        raise SftError(f"sft.data_path: {path} holds no transcript")
    return examples


def _warm_start_config(exp: ExperimentConfig) -> ExperimentConfig:
    """The experiment as the warm-start trains it: from `sft.init`, on the SFT schedule, no
    reference model or critic."""
    sft = exp.sft
    if not sft.init or not sft.data_path:
        raise SftError("sft.init and sft.data_path: both are needed to run `rollmesh sft` "
                       "(the checkpoint to start from and the demonstrations)")
    trainer = dataclasses.replace(
        exp.trainer, lr=sft.lr or exp.trainer.lr, total_steps=sft.steps,
        warmup_steps=sft.warmup_steps, lr_schedule="cosine", mini_batches=1, ranks=1)
    algorithm = dataclasses.replace(exp.algorithm, use_reference=False, kl_coef=0.0,
                                    advantage="grpo")
    return dataclasses.replace(exp, model=dataclasses.replace(exp.model, path=sft.init),
                               trainer=trainer, algorithm=algorithm)


def _batch_data(batch: list[Example]) -> BatchData:
    """The examples right-padded as one batch; the loss mask is on the assistant tokens."""
    lengths = [len(e.ids) for e in batch]
    size, width = len(batch), max(lengths)
    tokens = torch.zeros(size, width, dtype=torch.long)
    mask = torch.zeros(size, width)
    for row, example in enumerate(batch):
        tokens[row, :lengths[row]] = torch.tensor(example.ids)
        mask[row, :lengths[row]] = torch.tensor(example.mask, dtype=torch.float32)
    return BatchData(tokens=tokens, lengths=torch.tensor(lengths), mask=mask,
                     behaviour=torch.zeros(size, width),
                     versions=torch.full((size, width), -1, dtype=torch.long),
                     rewards=torch.zeros(size), group_index=torch.arange(size))


def _batch_loss(state: Any, batch: list[Example]) -> tuple[float, int]:
    """Backward of the token-mean cross-entropy over `batch`'s assistant tokens, accumulated
    over micro-batches; (loss, assistant tokens)."""
    targets = sum(sum(e.mask[1:]) for e in batch)
    total = 0.0
    for _, mb in micro_batches(state, _batch_data(batch)):
        ids, mask = mb["tokens"], mb["mask"]
        logits = state.model(input_ids=ids,
                             attention_mask=mb["attention_mask"]).logits[:, :-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(logp * mask[:, 1:]).sum() / targets
        loss.backward()
        total += float(loss.detach())
    return total, targets


def train(exp: ExperimentConfig, log: Any, *, progress: Any = None) -> dict[str, Any]:
    """Warm-start `exp.sft.init` on `exp.sft.data_path` and export it to `exp.model.path`;
    returns the summary written beside it (`sft.json`)."""
    from rollmesh.models.loading import resolve_device
    from rollmesh.training.state import build_state

    warm = _warm_start_config(exp)
    device = resolve_device(exp.trainer.device)
    state = build_state(warm, device=device)
    examples = load_transcripts(exp.sft.data_path, state.tokenizer, exp.model.max_context)
    rng = random.Random(exp.seed)
    losses: list[float] = []
    started = time.monotonic()
    for step in range(exp.sft.steps):
        batch = rng.sample(examples, min(exp.sft.batch_size, len(examples)))
        state.optimizer.zero_grad(set_to_none=True)
        loss, tokens = _batch_loss(state, batch)
        grad_norm = torch.nn.utils.clip_grad_norm_(state.model.parameters(),
                                                   exp.trainer.grad_clip)
        state.optimizer.step()
        state.scheduler.step()
        losses.append(round(loss, 6))
        if step % 25 == 0 or step == exp.sft.steps - 1:
            log.info("sft_step", step=step + 1, steps=exp.sft.steps, loss=round(loss, 4),
                     grad_norm=round(float(grad_norm), 4), tokens=tokens,
                     lr=state.scheduler.get_last_lr()[0])
            if progress is not None:
                progress(f"rollmesh sft: step {step + 1}/{exp.sft.steps} loss {loss:.4f} "
                         f"elapsed {time.monotonic() - started:.0f}s")
    out = Path(exp.model.path)
    checkpoint.export_hf(out, model=state.model, tokenizer=state.tokenizer,
                         lora=state.exp.model.lora)
    summary = {"init": exp.sft.init, "data_path": exp.sft.data_path, "examples": len(examples),
               "steps": exp.sft.steps, "batch_size": exp.sft.batch_size,
               "lr": warm.trainer.lr, "seconds": round(time.monotonic() - started, 1),
               "loss_first": losses[0], "loss_last": losses[-1], "losses": losses}
    (out / "sft.json").write_text(json.dumps(summary, indent=1) + "\n")
    log.info("sft_done", path=str(out), loss_first=losses[0], loss_last=losses[-1],
             seconds=summary["seconds"])
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollmesh sft", description=__doc__.splitlines()[0])
    p.add_argument("config", metavar="CONFIG", help="an experiment file with an [sft] table")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    log = configure_logging("sft", stream=sys.stderr)
    try:
        exp = load_experiment(args.config, overrides=args.overrides)
        summary = train(exp, log, progress=lambda line: print(line, flush=True))
    except (ConfigError, SftError) as e:
        print(f"rollmesh sft: {e}", file=sys.stderr)
        return 2
    print(f"rollmesh sft: wrote {exp.model.path} (loss {summary['loss_first']:.3f} -> "
          f"{summary['loss_last']:.3f} in {summary['steps']} steps, {summary['seconds']:.0f}s)")
    return 0
