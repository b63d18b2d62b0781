"""An engine's start under LoRA: write the identity adapter, then become the engine.

    python -m rollmesh.engine.lora_init --model PATH --rank R --alpha A --targets q_proj,...
        [--rslora] [--trust-remote-code] --out DIR -- <the engine's command line>

The engines serve the policy's adapter under the name `policy` from their first request (every
`/generate` names it), so each starts with an adapter already loaded (`--lora-paths
policy=DIR`): zeros of every adapter's shape, which changes nothing. That is version 0, the
trainer's too (its first adapters have B = 0: the adapted policy is the base model exactly).
The shapes come from the model's own modules, built on the meta device (no weights read), with
peft's layers put in as the trainer puts them (`rollmesh.models.lora.inject`). A restarted
engine writes it again and starts at version 0, as one with full weights starts from the
initial weights; the trainer then sends it the current adapter.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from rollmesh.config import LoraConfig
from rollmesh.models.lora import config_dict, identity_adapter, inject, write_adapter


def _empty_model(path: str, trust_remote_code: bool) -> torch.nn.Module:
    from rollmesh.models.loading import build_tiny, is_tiny
    from rollmesh.models.sharded import empty_causal_lm, parameters_on_meta

    if is_tiny(path):
        with parameters_on_meta():
            model, _ = build_tiny(path)
        return model
    return empty_causal_lm(path, torch.float32, trust_remote_code=trust_remote_code)


def write_identity(out: str, model_path: str, cfg: LoraConfig, *,
                   trust_remote_code: bool = False) -> None:
    from rollmesh.models.sharded import parameters_on_meta

    model = _empty_model(model_path, trust_remote_code)
    with parameters_on_meta():
        inject(model, cfg)
    write_adapter(out, identity_adapter(model), config_dict(cfg, model_path))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("lora_init: expected `-- <engine command>` after its own flags", file=sys.stderr)
        return 2
    cut = argv.index("--")
    ours, engine = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="python -m rollmesh.engine.lora_init")
    parser.add_argument("--model", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--alpha", type=float, required=True)
    parser.add_argument("--targets", required=True)
    parser.add_argument("--rslora", action="store_true")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(ours)
    if not engine:
        parser.error("no engine command after `--`")
    cfg = LoraConfig(rank=args.rank, alpha=args.alpha, target_modules=args.targets.split(","),
                     use_rslora=args.rslora)
    write_identity(args.out, args.model, cfg, trust_remote_code=args.trust_remote_code)
    sys.stdout.flush()
    os.execvp(engine[0], engine)  # a bare `python3` is looked up on PATH
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
