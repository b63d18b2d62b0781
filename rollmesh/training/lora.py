"""LoRA on the trainer (`[model.lora]`, rank > 0): the policy's adapters, trained alone.

- `rollmesh.models.lora.inject` puts peft's LoRA layers into the policy before it is sharded
  (FSDP2 per decoder layer as ever); only the adapters require grad and only they are in the
  optimizer.
- `initial_values`: A drawn as peft draws it (kaiming-uniform, a = sqrt(5): U(-1/sqrt(in),
  1/sqrt(in))) from a generator seeded by the seed and the module's name, B zero; the same in
  every process and for any number of ranks. With B zero the adapted policy is the base model
  exactly, as the engines' version 0 (the identity adapter).
- The reference policy is the base model: the same module with its adapters off
  (`adapters_disabled`), no second copy of the weights.
- A sync sends the adapters alone, in peft's format (`adapter_tensors`,
  `rollmesh.models.lora.write_adapter`).
- `merged_state_dict`: the policy with each adapter merged (W + scale * B @ A), under the base
  model's own names: what `policy/` exports (`rollmesh.training.checkpoint.export_hf`).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor

from rollmesh.models.lora import ADAPTER, is_adapter, peft_key
from rollmesh.training.ranks import full_tensor


def initial_values(model: torch.nn.Module, seed: int) -> dict[str, Tensor]:
    """Every adapter parameter's first value (float32, full shape): A ~ U(-1/sqrt(in),
    1/sqrt(in)) from a generator seeded by `seed` and the name, B = 0."""
    out = {}
    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue
        if ".lora_B." in name:
            out[name] = torch.zeros(tuple(p.shape))
            continue
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        bound = 1.0 / math.sqrt(p.shape[1])
        out[name] = (torch.rand(tuple(p.shape), generator=g) * 2 - 1) * bound
    return out


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model: every LoRA layer of `model` off while inside (the reference policy)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


def adapter_names(model: torch.nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if is_adapter(n)]


def adapter_tensors(model: torch.nn.Module, dtype: torch.dtype | None = None,
                    ) -> Iterator[tuple[str, Tensor]]:
    """(peft key, the whole tensor on the CPU) for every adapter parameter, model order: a
    collective under FSDP2 (every rank iterates it to the end, in lock-step)."""
    params = dict(model.named_parameters())
    for name in adapter_names(model):
        t = full_tensor(params[name]).detach()
        yield peft_key(name), (t if dtype is None else t.to(dtype)).cpu().contiguous()


def merged_state_dict(model: torch.nn.Module, is_main: bool,
                      dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The policy with its adapters merged, under the base model's names (`.base_layer`
    dropped, no adapter keys): W + scaling * B @ A in float32 (each LoRA layer's own scaling),
    then `dtype`. Whole, on rank 0 (empty elsewhere); a collective on every rank."""
    params = dict(model.named_parameters())
    out: dict[str, Tensor] = {}
    for name, p in params.items():
        if is_adapter(name):
            continue
        t = full_tensor(p).detach()
        if name.endswith(".base_layer.weight"):
            module = name[: -len(".base_layer.weight")]
            a = full_tensor(params[f"{module}.lora_A.{ADAPTER}.weight"]).detach().float()
            b = full_tensor(params[f"{module}.lora_B.{ADAPTER}.weight"]).detach().float()
            t = t.float() + model.get_submodule(module).scaling[ADAPTER] * (b @ a)
        if is_main:
            key = name.replace(".base_layer.", ".")
            out[key] = (t if dtype is None else t.to(dtype)).cpu().contiguous()
    return out

