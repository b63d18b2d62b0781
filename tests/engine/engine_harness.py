"""Helpers for the engine tests: a real `rollmesh engine` process on a free port, real HTTP,
and reference computations on the same model built in the test process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def repo_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


class Engine:
    """One `rollmesh engine` server process."""

    def __init__(self, log_path: Path, *args: str, model: str = "tiny") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - held for the process lifetime
        cmd = [sys.executable, "-m", "rollmesh", "engine", "--model", model,
               "--port", str(self.port), "--seed", "0", *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=repo_env(), stdout=self._log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180  # a loaded 2-core machine took over 90 s (five at once)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(OSError):  # not listening yet
                if self.get("/health")[0] == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"engine did not become healthy:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def request(self, method: str, path: str, body: Any = None, raw: bytes | None = None,
                timeout: float = 120) -> tuple[int, Any]:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, payload = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, payload = e.code, e.read()
        try:
            return status, json.loads(payload) if payload else None
        except json.JSONDecodeError:
            return status, payload.decode()

    def get(self, path: str) -> tuple[int, Any]:
        return self.request("GET", path)

    def post(self, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return self.request("POST", path, body if body is not None else {}, **kw)

    def generate(self, input_ids: list[int], **sampling: Any) -> dict[str, Any]:
        rid = sampling.pop("rid", None)
        body = {"input_ids": input_ids, "return_logprob": True, "sampling_params": sampling}
        if rid is not None:
            body["rid"] = rid
        status, out = self.post("/generate", body)
        assert status == 200, out
        return out

    def stats(self) -> dict[str, Any]:
        return self.get("/get_server_info")[1]["internal_states"][0]

    def stop(self, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def chat_prompt(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True)["input_ids"]


def teacher_forced_logprobs(model: Any, prompt: list[int], output: list[int]) -> list[float]:
    """log p(output[i] | prompt + output[:i]) from one full forward pass, float32."""
    import torch

    ids = torch.tensor([prompt + output])
    logits = model(input_ids=ids).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logprobs.gather(1, torch.tensor(output)[:, None])[:, 0].tolist()


def greedy_decode(model: Any, prompt: list[int], n: int) -> list[int]:
    """Reference greedy decoding without cache or batching (stops at n tokens only)."""
    import torch

    ids = list(prompt)
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def write_lora_adapter(path: Path, model: Any, modules: list[str], r: int = 8,
                       seed: int = 0) -> None:
    """A LoRA adapter for `model` in peft's saved format (adapter_config.json +
    adapter_model.safetensors), random A and B, on the Linear modules named `modules`, without
    peft itself."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in modules:
        out_features, in_features = model.get_submodule(name).weight.shape
        prefix = f"base_model.model.{name}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, in_features, generator=gen) * 0.1
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, r, generator=gen) * 0.1
    save_file(tensors, str(path / "adapter_model.safetensors"))
    short = sorted({m.rsplit(".", 1)[-1] for m in modules})
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": short,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "base_model_name_or_path": "tiny"}))
