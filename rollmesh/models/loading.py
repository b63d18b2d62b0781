"""Models the built-in engine serves: a local Hugging Face checkpoint, or `tiny`.

A checkpoint directory (config.json, safetensors, tokenizer files with a chat template) loads
with the attention kernel its architecture supports (`attention_implementation`: SDPA, or eager
for Gemma2 and others without it), its tokenizer from `model.tokenizer_path` when given, and its
own modelling code only with `model.trust_remote_code`. Tested on Qwen2.5, Qwen3, Llama-3.1
and Gemma2 checkpoints (tests/unit/test_architectures.py).

`tiny` is a small random-initialised Qwen2-architecture causal LM with a byte-level BPE
tokenizer (trained once on GSM8K text and shipped as `assets/tokenizer.json`) and a
ChatML chat template (`<|im_start|>`, `<|im_end|>` = eos, `<|endoftext|>` = pad). Every process
that builds the same spec gets bit-identical weights (seeded init on CPU, float32) and the same
tokenizer, so a trainer and its engines agree without sharing files.

Spec strings:
    tiny                                   the defaults below
    tiny:hidden=128,layers=4,heads=4,kv_heads=2,seed=1
keys (all positive integers; `seed` may be 0):
    hidden (64)  layers (2)  heads (4)  kv_heads (2)  intermediate (4 * hidden)
    ctx (4096, max_position_embeddings)  seed (0)
A spec with an unknown key, a non-integer value or inconsistent head counts raises
`ModelSpecError` naming the key.

Commands:
    python -m rollmesh.models.loading build-tokenizer --gsm8k DIR [--out PATH]
    python -m rollmesh.models.loading materialize SPEC PATH
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

ASSETS = Path(__file__).with_name("assets")
TOKENIZER_FILE = ASSETS / "tokenizer.json"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB_SIZE = 2048
# Qwen2's pre-tokenizer split: single digits (arithmetic-friendly), words, punctuation runs.
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class ModelSpecError(ValueError):
    """A `tiny:...` spec or a model path that cannot be used."""


@dataclass(frozen=True)
class TinySpec:
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 0  # 0 = 4 * hidden
    ctx: int = 4096
    seed: int = 0

    @classmethod
    def parse(cls, spec: str) -> TinySpec:
        name, _, rest = spec.partition(":")
        if name != "tiny":
            raise ModelSpecError(f"model spec {spec!r}: expected 'tiny' or 'tiny:key=value,...'")
        known = {f.name for f in fields(cls)}
        values: dict[str, int] = {}
        for item in filter(None, (s.strip() for s in rest.split(","))):
            key, eq, raw = item.partition("=")
            key = key.strip()
            if key not in known:
                raise ModelSpecError(
                    f"model spec {spec!r}: unknown key {key!r} (expected one of {sorted(known)})"
                )
            try:
                values[key] = int(raw.strip() if eq else "missing")
            except ValueError:
                raise ModelSpecError(
                    f"model spec {spec!r}: key {key!r} needs an integer value, got {raw!r}"
                ) from None
            if values[key] < (0 if key in ("seed", "intermediate") else 1):
                raise ModelSpecError(f"model spec {spec!r}: key {key!r} must be positive")
        parsed = cls(**values)
        if parsed.hidden % parsed.heads:
            raise ModelSpecError(f"model spec {spec!r}: hidden must be a multiple of heads")
        if parsed.heads % parsed.kv_heads:
            raise ModelSpecError(f"model spec {spec!r}: heads must be a multiple of kv_heads")
        if (parsed.hidden // parsed.heads) % 2:
            raise ModelSpecError(f"model spec {spec!r}: hidden / heads must be even (rotary)")
        return parsed


def is_tiny(model: str) -> bool:
    return model == "tiny" or model.startswith("tiny:")


def tiny_tokenizer() -> Any:
    """The committed tiny tokenizer, as a transformers fast tokenizer with the chat template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER_FILE),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=TinySpec().ctx,
        clean_up_tokenization_spaces=False,
    )


def build_tiny(spec: str = "tiny") -> tuple[Any, Any]:
    """(model, tokenizer) for a tiny spec: float32 on CPU, eval mode, identical in every process."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    s = TinySpec.parse(spec)
    tokenizer = tiny_tokenizer()
    tokenizer.model_max_length = s.ctx
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=s.hidden,
        intermediate_size=s.intermediate or 4 * s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        max_position_embeddings=s.ctx,
        tie_word_embeddings=False,  # tied random weights make greedy decoding repeat its input
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        dtype="float32",
    )
    config._attn_implementation = "sdpa"
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(s.seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    model.generation_config.bos_token_id = None
    model.config.name_or_path = spec
    return model.eval(), tokenizer


def materialize(spec: str, path: str | Path) -> Path:
    """Write tiny `spec` as a Hugging Face checkpoint directory (safetensors + tokenizer)."""
    model, tokenizer = build_tiny(spec)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelSpecError("--device cuda: CUDA is not available on this host")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # bf16 where it is fast (GPU); float32 on CPU, where bf16 matmuls are slow and lossy.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            dtype
        ]
    except KeyError:
        raise ModelSpecError(f"--dtype {dtype!r}: expected float32, bfloat16 or float16") from None


def load_model(model: str, device: torch.device, dtype: torch.dtype, *,
               tokenizer_path: str | None = None, trust_remote_code: bool = False,
               attn_implementation: str | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) for `tiny[:...]` or a local checkpoint directory; never the network.

    `tokenizer_path`: another directory to take the tokenizer from (`model.tokenizer_path`);
    `trust_remote_code`: let a checkpoint's own modelling and tokenizer code run
    (`model.trust_remote_code`); `attn_implementation`: the attention kernel, by default the
    one `attention_implementation` picks for the architecture.
    """
    if is_tiny(model):
        m, tokenizer = build_tiny(model)
        if tokenizer_path is not None:
            tokenizer = load_tokenizer(tokenizer_path, trust_remote_code=trust_remote_code)
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        path = checkpoint_dir(model)
        config = AutoConfig.from_pretrained(path, local_files_only=True,
                                            trust_remote_code=trust_remote_code)
        attn = attn_implementation or attention_implementation(config)
        m = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True, trust_remote_code=trust_remote_code,
            **({"attn_implementation": attn} if attn else {}),
        )
        tokenizer = load_tokenizer(tokenizer_path or model, trust_remote_code=trust_remote_code)
    return m.to(device=device, dtype=dtype).eval(), tokenizer


def checkpoint_dir(model: str) -> Path:
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ModelSpecError(
            f"model {model!r}: not 'tiny[:...]' and not a checkpoint directory with config.json"
        )
    return path


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str, *, trust_remote_code: bool = False) -> Any:
    """The tokenizer of `tiny[:...]` (the built-in one) or of a local directory."""
    if is_tiny(path):
        return tiny_tokenizer()
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise ModelSpecError(f"tokenizer {path!r}: not 'tiny[:...]' and not a directory")
    # transformers 5 builds an empty tokenizer of the config's type from a directory with no
    # tokenizer files, without a word: refuse it here instead.
    if not any((Path(path) / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelSpecError(
            f"tokenizer {path!r}: no tokenizer files ({', '.join(_TOKENIZER_FILES)}); "
            "set model.tokenizer_path (--tokenizer-path) to the tokenizer's directory")
    return AutoTokenizer.from_pretrained(path, local_files_only=True,
                                         trust_remote_code=trust_remote_code)


def attention_implementation(config: Any) -> str | None:
    """The attention kernel to load `config`'s architecture with: the one its config.json names,
    else PyTorch's fused SDPA where the architecture supports it, else the eager reference
    (Gemma2, for one, has no SDPA path: its logit soft-capping needs eager). None (transformers
    decides) for an architecture transformers does not know, i.e. remote code."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    named = getattr(config, "_attn_implementation_internal", None)
    if isinstance(named, str):
        return named
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def build_tokenizer(gsm8k_dir: str | Path, out: str | Path = TOKENIZER_FILE) -> Path:
    """Train the tiny byte-level BPE tokenizer on GSM8K train text and write tokenizer.json."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    rows = Path(gsm8k_dir, "train.jsonl").read_text(encoding="utf-8").splitlines()
    texts = [t for row in rows if row.strip() for t in json.loads(row).values()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out), pretty=False)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rollmesh.models.loading", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build-tokenizer", help="retrain assets/tokenizer.json from GSM8K")
    b.add_argument("--gsm8k", required=True, help="directory holding train.jsonl")
    b.add_argument("--out", default=str(TOKENIZER_FILE))
    m = sub.add_parser("materialize", help="write a tiny spec as a checkpoint directory")
    m.add_argument("spec")
    m.add_argument("path")
    args = p.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        if args.command == "build-tokenizer":
            out = build_tokenizer(args.gsm8k, args.out)
        else:
            out = materialize(args.spec, args.path)
    except (ModelSpecError, OSError) as e:
        print(f"rollmesh: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
