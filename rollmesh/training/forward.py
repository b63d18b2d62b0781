"""The policy's forward pass as the trainer runs it: per-token log-probs (and entropy) of a
micro-batch, from the last hidden states, never from full-vocabulary logits.

A micro-batch (`rollmesh.training.batching.model_inputs`) is either one packed row of its real
tokens (`trainer.packing`, the default: positions restart per sequence, attention confined to
each sequence by `rollmesh.models.varlen`) or right-padded rows. Either way only the positions
that predict a loss token are scored (`head_pos`, `head_tgt`): prompt and observation tokens
never reach the LM head. The results come back token-aligned, [B, W] like the micro-batch's
mask, 0 outside the mask.

How the head is computed: for the architectures in `FUSED_HEAD` (their causal-LM forward hands
the head's output straight back, Gemma's soft-cap aside), the model's own forward runs with its
output embedding's `forward` replaced, for that call, by `rollmesh.algorithms.head
.head_logprobs` on the selected hidden states, so the head's weight is used inside the model's
forward (where FSDP2 has it gathered, and from where its gradient is reduced as any other). Any
other architecture takes the full logits and the same selection (`token_logprobs`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from rollmesh.algorithms.head import EntropyMode, head_logprobs
from rollmesh.algorithms.logits import entropy_from_logits, token_logprobs

# Causal LMs whose forward returns lm_head(hidden) as its logits, optionally soft-capped by
# config.final_logit_softcapping (handled inside the fused head instead).
FUSED_HEAD = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM",
    "Phi3ForCausalLM",
})


def fused_head_supported(model: torch.nn.Module) -> bool:
    """The fused head computes lm_head(hidden) from the head's weight: not for a head wrapped
    by a LoRA adapter (`model.lora.target_modules` naming lm_head), whose own forward adds it."""
    names = {cls.__name__ for cls in type(model).__mro__}
    head = model.get_output_embeddings()
    return bool(names & FUSED_HEAD) and head is not None and not hasattr(head, "base_layer")


@contextlib.contextmanager
def _head_replaced(model: torch.nn.Module, select: Tensor, targets: Tensor, temperature: float,
                   entropy: EntropyMode, out: dict[str, Any]) -> Iterator[None]:
    head = model.get_output_embeddings()
    config = model.config
    softcap = getattr(config, "final_logit_softcapping", None)

    def forward(hidden: Tensor) -> Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, select)
        logp, ent = head_logprobs(flat, head.weight, targets, bias=head.bias,
                                  temperature=temperature, softcap=softcap, entropy=entropy)
        out["entropy"] = ent
        return logp

    head.forward = forward
    if softcap is not None:
        config.final_logit_softcapping = None
    try:
        yield
    finally:
        del head.forward
        if softcap is not None:
            config.final_logit_softcapping = softcap


def _autocast(state: Any) -> contextlib.AbstractContextManager:
    if state.autocast:
        return torch.autocast(state.device.type, dtype=state.compute_dtype)
    return contextlib.nullcontext()


def _model_kwargs(mb: dict[str, Any]) -> dict[str, Any]:
    if "input_ids" in mb:  # one packed row
        from rollmesh.models.varlen import packed_kwargs

        return {"input_ids": mb["input_ids"], "position_ids": mb["position_ids"],
                **packed_kwargs(mb["segments"], mb["input_ids"].device)}
    return {"input_ids": mb["tokens"], "attention_mask": mb["attention_mask"]}


def token_logprobs_of(state: Any, model: torch.nn.Module, mb: dict[str, Any], *,
                      entropy: EntropyMode = "none") -> tuple[Tensor, Tensor | None]:
    """(log p(token) [B, W], entropy [B, W] or None) of the micro-batch's loss tokens under
    `model` at the sampling temperature; float32, 0 outside the mask. Differentiable when grad
    is enabled; the entropy only with entropy="grad"."""
    select, targets = mb["head_pos"], mb["head_tgt"]
    temperature = state.temperature
    kwargs = _model_kwargs(mb)
    found: dict[str, Any] = {}
    with _autocast(state):
        if fused_head_supported(model):
            with _head_replaced(model, select, targets, temperature, entropy, found):
                logp = model(**kwargs, use_cache=False).logits
            ent = found.get("entropy")
        else:
            logits = model(**kwargs, use_cache=False).logits
            picked = logits.reshape(-1, logits.shape[-1]).index_select(0, select)
            logp = token_logprobs(picked, targets, temperature)
            ent = None
            if entropy != "none":
                ent = entropy_from_logits(picked if entropy == "grad" else picked.detach(),
                                          temperature)
    shape = mb["tokens"].shape
    scatter = mb["head_out"]

    def aligned(values: Tensor) -> Tensor:
        flat = values.new_zeros(shape.numel()).index_copy(0, scatter, values.float())
        return flat.view(shape)

    return aligned(logp.reshape(-1)), (None if ent is None else aligned(ent.reshape(-1)))
