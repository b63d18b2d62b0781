"""Starting inference servers: real SGLang on GPU hosts, or rollmesh's built-in engine.

Both are separate processes started from a command line (locally or over SSH by the
launcher), then awaited through `/health_generate` with the same client. This module never
imports sglang: the package is an optional extra installed only on GPU hosts, and a CPU host
only ever builds the built-in engine's command.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Sequence

from rollmesh.config import EngineConfig, ModelConfig
from rollmesh.config.engine_args import EngineArgsError, check_builtin_args  # noqa: F401 - re-exported


@dataclass
class EngineLaunch:
    """One inference server to start: its command, environment and URL."""

    kind: str  # builtin | sglang
    host: str
    port: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def shell(self) -> str:
        """The command as one shell line (for SSH and --dry-run)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + shlex.join(self.argv)


def sglang_argv(model_path: str, host: str, port: int, *, tp_size: int = 1,
                mem_fraction_static: float = 0.8, weight_version: str = "0",
                dtype: str = "auto", random_seed: int | None = None,
                max_running_requests: int | None = None,
                extra_args: Sequence[str] = (), python: str = sys.executable,
                api_key: str | None = None, tokenizer_path: str | None = None,
                trust_remote_code: bool = False, admin_api_key: str | None = None) -> list[str]:
    """`python -m sglang.launch_server` with the flags rollmesh relies on.

    --skip-server-warmup: the launcher waits for /health_generate itself.
    --weight-version: engines report the version that produced each token; rollmesh counts
    versions from 0 so the staleness arithmetic works from the first sample.
    --enable-memory-saver is left to `extra_args` (it needs a colocated setup).
    """
    argv = [python, "-m", "sglang.launch_server", "--model-path", model_path,
            "--host", host, "--port", str(port), "--tp-size", str(tp_size),
            "--mem-fraction-static", str(mem_fraction_static), "--skip-server-warmup",
            "--weight-version", weight_version, "--dtype", dtype]
    argv += _model_flags(tokenizer_path, trust_remote_code)
    if max_running_requests is not None:
        argv += ["--max-running-requests", str(max_running_requests)]
    if random_seed is not None:
        argv += ["--random-seed", str(random_seed)]
    if api_key:  # SGLang takes the keys themselves on its command line
        argv += ["--api-key", api_key]
    if admin_api_key:  # the admin routes take this one only (rollmesh.engine.auth)
        argv += ["--admin-api-key", admin_api_key]
    return argv + list(extra_args)


def _model_flags(tokenizer_path: str | None, trust_remote_code: bool) -> list[str]:
    """`model.tokenizer_path` and `model.trust_remote_code` as flags both servers take."""
    flags = ["--tokenizer-path", tokenizer_path] if tokenizer_path else []
    return flags + (["--trust-remote-code"] if trust_remote_code else [])


def builtin_argv(model_path: str, host: str, port: int, *, dtype: str = "auto",
                 weight_version: str = "0", max_running_requests: int = 64,
                 seed: int | None = None, device: str = "auto",
                 python: str = sys.executable, api_key_file: str | None = None,
                 tokenizer_path: str | None = None, trust_remote_code: bool = False,
                 extra_args: Sequence[str] = (),
                 admin_api_key_file: str | None = None) -> list[str]:
    """`python -m rollmesh engine` with rollmesh's flags, then `extra_args` (the engine's own
    flags, as for SGLang: a later flag overrides an earlier one, so `--seed 7` wins)."""
    argv = [python, "-m", "rollmesh", "engine", "--model", model_path, "--host", host,
            "--port", str(port), "--weight-version", weight_version, "--dtype", dtype,
            "--max-running-requests", str(max_running_requests), "--device", device,
            *_model_flags(tokenizer_path, trust_remote_code)]
    if seed is not None:
        argv += ["--seed", str(seed)]
    if api_key_file:
        argv += ["--api-key-file", api_key_file]
    if admin_api_key_file:
        argv += ["--admin-api-key-file", admin_api_key_file]
    return argv + list(extra_args)


def engine_launch(engine: EngineConfig, model: ModelConfig, host: str, port: int, *,
                  gpus: Sequence[int] = (), seed: int | None = None, weight_version: str = "0",
                  python: str = sys.executable, api_key: str | None = None,
                  api_key_file: str | None = None, lora_dir: str | None = None,
                  admin_api_key: str | None = None,
                  admin_api_key_file: str | None = None) -> EngineLaunch:
    """The server the experiment asks for, on `host:port`, pinned to `gpus`; with the run's
    API and admin keys (SGLang: `--api-key`, `--admin-api-key`; the built-in engine reads
    `api_key_file`, `admin_api_key_file`: rollmesh.engine.auth). Under LoRA
    (`model.lora.rank > 0`) it starts through `rollmesh.engine.lora_init`, which writes the
    identity adapter to `lora_dir` first, and serves it as `policy` (SGLang's LoRA flags)."""
    dtype = model.dtype
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))} if gpus else {}
    if engine.kind == "sglang":
        argv = sglang_argv(model.path, host, port, tp_size=engine.tp_size,
                           mem_fraction_static=engine.mem_fraction_static,
                           max_running_requests=engine.max_running_requests,
                           weight_version=weight_version, dtype=dtype, random_seed=seed,
                           extra_args=engine.extra_args, python=python, api_key=api_key,
                           admin_api_key=admin_api_key, tokenizer_path=model.tokenizer_path,
                           trust_remote_code=model.trust_remote_code)
    else:
        argv = builtin_argv(model.path, host, port, dtype=dtype, weight_version=weight_version,
                            max_running_requests=engine.max_running_requests, seed=seed,
                            device="cuda" if gpus else "auto", python=python,
                            api_key_file=api_key_file, tokenizer_path=model.tokenizer_path,
                            trust_remote_code=model.trust_remote_code,
                            extra_args=engine.extra_args,
                            admin_api_key_file=admin_api_key_file)
        check_builtin_args(engine.extra_args)
    if model.lora.enabled:
        argv = lora_argv(argv, model, lora_dir, python)
    return EngineLaunch(engine.kind, host, port, argv, env)


def lora_argv(argv: list[str], model: ModelConfig, lora_dir: str | None,
              python: str) -> list[str]:
    """`argv` with SGLang's LoRA flags (both servers take them), behind the step that writes
    the identity adapter they start with (`rollmesh.engine.lora_init`)."""
    if not lora_dir:
        raise ValueError("model.lora.rank > 0: the engine needs a directory for its initial "
                         "adapter (lora_dir)")
    lora = model.lora
    flags = ["--enable-lora", "--lora-paths", f"policy={lora_dir}",
             "--max-lora-rank", str(lora.rank),
             "--lora-target-modules", *lora.target_modules]
    init = [python, "-m", "rollmesh.engine.lora_init", "--model", model.path,
            "--rank", str(lora.rank), "--alpha", str(lora.scale_alpha),
            "--targets", ",".join(lora.target_modules), "--out", lora_dir]
    init += ["--rslora"] * lora.use_rslora + ["--trust-remote-code"] * model.trust_remote_code
    return init + ["--"] + argv + flags


def start(launch: EngineLaunch, *, log_path: str | None = None) -> subprocess.Popen:
    """Start a server on this host (the launcher does the same over SSH for other hosts)."""
    import os

    out = open(log_path, "ab") if log_path else None
    try:
        return subprocess.Popen(launch.argv, env={**os.environ, **launch.env}, stdout=out,
                                stderr=subprocess.STDOUT if out else None,
                                start_new_session=True)
    finally:
        if out is not None:
            out.close()
