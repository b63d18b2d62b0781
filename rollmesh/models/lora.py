"""LoRA adapters in peft's format, shared by the trainer (`rollmesh.training.lora`), the engines'
start (`rollmesh.engine.lora_init`) and the built-in engine.

`inject` puts peft's LoRA layers into a causal LM in place (`peft.inject_adapter_in_model`: the
model keeps its class and its `model.layers`). Each wrapped Linear keeps its weight as
`<module>.base_layer.weight`; the adapters are `<module>.lora_A.default.weight` [r, in] and
`<module>.lora_B.default.weight` [out, r]. On disk (`write_adapter`) an adapter is what peft's
`save_pretrained` writes: `adapter_config.json` + `adapter_model.safetensors`, keys
`base_model.model.<module>.lora_{A,B}.weight` (`peft_key`), which SGLang's `/load_lora_adapter`
and the built-in engine read. `identity_adapter`: zeros of every adapter's shape, the engines'
version 0 (it changes nothing, as the trainer's first adapter, whose B is zero). `cfg` is
`[model.lora]` (`rollmesh.config.LoraConfig`: rank, scale_alpha, dropout, target_modules,
use_rslora); this folder imports no other.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor


ADAPTER = "default"  # peft's adapter name inside the modules
PEFT_PREFIX = "base_model.model."  # what peft's saved keys start with
ADAPTER_NAME = "policy"  # the engines' name for the policy's adapter (requests' lora_path)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def peft_config(cfg: Any, base_path: str | None = None) -> Any:
    import peft

    return peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.scale_alpha, lora_dropout=cfg.dropout,
                           target_modules=list(cfg.target_modules), use_rslora=cfg.use_rslora,
                           bias="none", base_model_name_or_path=base_path)



def inject(model: torch.nn.Module, cfg: Any) -> torch.nn.Module:
    """peft's LoRA layers into `model` (in place); only the adapters require grad. Raises
    ValueError naming the targets when none of them is in the model."""
    import peft

    try:
        peft.inject_adapter_in_model(peft_config(cfg), model, adapter_name=ADAPTER)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"model.lora.target_modules {list(cfg.target_modules)}: {e}") from None
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    if not any(is_adapter(n) for n, _ in model.named_parameters()):
        raise ValueError(f"model.lora.target_modules {list(cfg.target_modules)}: no module "
                         "of the model was wrapped")
    return model


def is_adapter(name: str) -> bool:
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def has_adapters(model: torch.nn.Module) -> bool:
    return any(is_adapter(n) for n, _ in model.named_parameters())


def peft_key(name: str) -> str:
    """A parameter's name -> its key in peft's saved file (no adapter name, peft's prefix)."""
    return PEFT_PREFIX + name.replace(f".lora_A.{ADAPTER}.", ".lora_A.").replace(
        f".lora_B.{ADAPTER}.", ".lora_B.")


def config_dict(cfg: Any, base_path: str | None) -> dict[str, Any]:
    """adapter_config.json's content, as peft writes it (sets as sorted lists)."""
    d = peft_config(cfg, base_path).to_dict()
    return json.loads(json.dumps(d, default=lambda v: sorted(v) if isinstance(v, set)
                                 else str(v)))


def write_adapter(path: str | Path, tensors: dict[str, Tensor], config: dict[str, Any]) -> int:
    """The adapter in peft's format at `path` (written beside it, then renamed into place: a
    reader never sees half of it); returns the bytes of its tensors file."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
        for f in tmp.iterdir():
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
        if path.exists():
            shutil.rmtree(path)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return (path / WEIGHTS_FILE).stat().st_size


def identity_adapter(model: torch.nn.Module) -> dict[str, Tensor]:
    """Zeros of every adapter's shape (an adapter that changes nothing: version 0 on the
    engines), peft keys, float32."""
    return {peft_key(n): torch.zeros(tuple(p.shape), dtype=torch.float32)
            for n, p in model.named_parameters() if is_adapter(n)}
