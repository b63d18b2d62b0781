"""The built-in engine's command line: its parser, which the engine reads at start
(`rollmesh.engine.builtin.server`) and the config checks `engine.extra_args` against before
anything starts (`EngineConfig.validate`). It imports nothing of rollmesh, so that the config
schema can read it without reaching into the engine.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

# The tool-call grammars the built-in engine's OpenAI routes parse (SGLang's parser names).
TOOL_CALL_PARSERS = ("qwen25", "qwen", "hermes")
# Tokens of prompt KV the built-in engine's prefix cache keeps by default.
DEFAULT_PREFIX_CACHE_TOKENS = 65536


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def parser(description: str | None = None) -> argparse.ArgumentParser:
    """The built-in engine's command line (`rollmesh engine`), which it parses at start."""
    p = argparse.ArgumentParser(prog="rollmesh engine", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="'tiny[:key=value,...]' or a checkpoint dir")
    p.add_argument("--tokenizer-path", default=None,
                   help="tokenizer directory (default: the model's own), as SGLang's flag")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let the checkpoint's own modelling and tokenizer code run")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--max-requests-per-call", type=int, default=4096,
                   help="the most requests one call may make (prompts times n); more is a 400, "
                        "not a queue of millions")
    p.add_argument("--seed", type=int, default=None, help="seed of the shared sampling RNG")
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="prefill every request's prompt itself, as SGLang's flag: no prefix "
                        "cache, and the samples of one request (n > 1) or requests for the same "
                        "prompt admitted together no longer share one prefill")
    p.add_argument("--prefix-cache-max-tokens", type=_non_negative,
                   default=DEFAULT_PREFIX_CACHE_TOKENS,
                   help="tokens of prompt KV the prefix cache keeps (least recently used "
                        "evicted first; every weight update clears it); 0: share prefills only "
                        "among requests admitted together")
    p.add_argument("--decode-backend", choices=["auto", "fast", "hf"], default="auto",
                   help="fast: the slot-cache decode step (Llama/Qwen2/Qwen3); hf: the model's "
                        "own forward; auto: fast where the architecture allows it")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="run the fast decode step eagerly on CUDA too, as SGLang's flag")
    p.add_argument("--api-key-file", default=None,
                   help="require `Authorization: Bearer <key>` on every route but /health, the "
                        "key read from this file (mode 0600); `rollmesh launch` makes one per run")
    p.add_argument("--admin-api-key-file", default=None,
                   help="as SGLang's --admin-api-key: the admin routes (weights, version, pause, "
                        "abort, flush, memory, LoRA) take this key only, the others "
                        "--api-key-file's (rollmesh.engine.auth)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id of the OpenAI routes (/v1/models); default: --model")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="parse tool calls of /v1/chat/completions outputs into `tool_calls`, "
                        "as SGLang's parser of that name (default: none, as SGLang)")
    # LoRA, SGLang's flags (server_args: the `lora` namespace); the built-in engine merges one
    # adapter into its weights (rollmesh/engine/builtin/lora.py)
    p.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve LoRA adapters (/load_lora_adapter, /generate lora_path); set by "
                        "--lora-paths too, as SGLang's flag. The built-in engine merges one "
                        "adapter at a time into its weights")
    p.add_argument("--lora-paths", nargs="*", default=None, metavar="ADAPTER",
                   help="adapters loaded at start, each NAME=PATH, PATH, or JSON "
                        '{"lora_name": ..., "lora_path": ...} (SGLang\'s forms); the built-in '
                        "engine takes at most one")
    p.add_argument("--max-lora-rank", type=_positive, default=None,
                   help="refuse adapters whose r is larger")
    p.add_argument("--lora-target-modules", nargs="*", default=None, metavar="MODULE",
                   help="the modules adapters may target (e.g. q_proj v_proj, or all); an "
                        "adapter with a factor for another module is refused")
    p.add_argument("--max-loaded-loras", type=_positive, default=None,
                   help="accepted as SGLang's flag; the built-in engine holds one adapter")
    p.add_argument("--max-loras-per-batch", type=_positive, default=8,
                   help="accepted as SGLang's flag; the built-in engine serves one adapter")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for torch (default: 1 for a tiny model, whose matmuls are "
                        "too small to split and whose extra threads only fight the other roles "
                        "for cores; otherwise OMP_NUM_THREADS or torch's default)")
    return p


class EngineArgsError(ValueError):
    """`engine.extra_args` that the built-in engine does not take."""


def check_builtin_args(extra_args: Sequence[str]) -> None:
    """Refuse, before anything starts, extra arguments the built-in engine's parser would refuse
    at start (an engine that exits with a usage line in its log is a worse error)."""
    if not extra_args:
        return
    p = parser()
    p.exit_on_error = False
    required = ["--model", "m", "--port", "1"]
    try:
        _, unknown = p.parse_known_args(required + list(extra_args))
    except argparse.ArgumentError as e:
        raise EngineArgsError(f"engine.extra_args: {e}") from None
    if unknown:
        raise EngineArgsError(
            f"engine.extra_args: the built-in engine does not take {unknown} "
            f"(see `rollmesh engine --help`)")
