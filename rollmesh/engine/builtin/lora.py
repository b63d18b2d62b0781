"""LoRA adapters in the built-in engine, as SGLang 0.5.23 serves them (docs/sglang-api.md, "LoRA"):

    POST /load_lora_adapter   {"lora_name", "lora_path", "pinned"?}
    POST /unload_lora_adapter {"lora_name"}
    /generate with "lora_path": "<name>" (or a list, one per prompt of a batch)

answered with SGLang's `LoRAUpdateOutput` (`{"success", "error_message", "loaded_adapters"}`,
200 or 400) and SGLang's messages where SGLang has one.

Unlike SGLang (which batches requests of several adapters over one base model), this engine
**merges** one adapter into the model's weights: W += scale * B @ A in float32, then cast to the
weight's dtype (scale = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora), keeping a
host copy of the base values of every weight it touched, so unloading (or a failed merge)
restores them bit for bit. Hence the limits:

- at most one adapter at a time: loading a second while one is merged is refused;
- while an adapter is merged every request must name it (`lora_path`), and none may name
  another one or none at all (it would be served with the adapter); without one merged, a
  request naming an adapter is refused (SGLang's message for a name never loaded; a name
  loaded before and unloaded since waits in the queue, as SGLang would reload it: it is
  served if the adapter is back when it is admitted, refused otherwise);
- an adapter changes only while no client request runs (pause in abort mode first); queued
  requests are checked again when admitted;
- full weight updates (/update_weights_from_*) are refused while an adapter is merged: the
  kept base copy would go stale.

The adapter directory is treated as hostile: only `adapter_config.json` (JSON) and
`adapter_model.safetensors` are read (never a pickle), and everything is checked (config
fields, key names, module types, shapes, dtypes, finite values) before any weight changes.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from rollmesh.engine.builtin.bodies import MalformedBody, read_body
from rollmesh.engine.builtin.sampling import BadRequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
MAX_CONFIG_BYTES = 1 << 20
# peft's saved key of one LoRA factor: base_model.model.<module path>.lora_A.weight
_KEY = re.compile(r"^base_model\.model\.(?P<module>[A-Za-z0-9_.]+)\.lora_(?P<ab>[AB])\.weight$")
# adapter_config.json fields that change what the adapter computes in ways a plain merge of
# B @ A does not reproduce: refused when set to anything but null/false/empty.
_REFUSED_CONFIG = {
    "use_dora": "DoRA adapters (use_dora) are not supported",
    "modules_to_save": "modules_to_save (fully trained modules beside the adapter) are not "
                       "supported",
    "rank_pattern": "rank_pattern (per-layer ranks) is not supported",
    "alpha_pattern": "alpha_pattern (per-layer alphas) is not supported",
    "lora_bias": "lora_bias (a bias on lora_B) is not supported",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows) are not "
                               "supported",
    "target_parameters": "target_parameters (adapters on raw parameters) are not supported",
    "use_qalora": "QA-LoRA adapters (use_qalora) are not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "layer_replication": "layer_replication is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
}
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


class LoRAError(ValueError):
    """An adapter or a request the engine refuses; the message names the field or key."""


def _keys_repr(names: Any) -> str:
    """How SGLang prints its registry's names: a dict's keys()."""
    return repr({n: None for n in names}.keys())


def parse_lora_paths(values: list[str] | None) -> list[tuple[str, str]]:
    """`--lora-paths` in SGLang's forms (argparse_actions.LoRAPathAction, lora_hook.py):
    `NAME=PATH`, `PATH` (named by itself) or a JSON object with lora_name and lora_path."""
    out = []
    for raw in values or []:
        item = raw.strip()
        if item.startswith("{") and item.endswith("}"):
            try:
                obj = json.loads(item)
            except json.JSONDecodeError as e:
                raise LoRAError(f"--lora-paths {item!r}: not valid JSON: {e}") from None
            if not (isinstance(obj, dict) and isinstance(obj.get("lora_name"), str)
                    and isinstance(obj.get("lora_path"), str)):
                raise LoRAError(f"{item!r} looks like a JSON str, but it does not contain "
                                "'lora_name' and 'lora_path' keys.")
            out.append((obj["lora_name"], obj["lora_path"]))
        elif "=" in item:
            name, path = item.split("=", 1)
            out.append((name, path))
        else:
            out.append((item, item))
    return out


@dataclass
class Adapter:
    """A checked adapter, ready to merge: per Linear module (by name) its (A, B) factors."""

    name: str
    path: str
    rank: int
    scale: float
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _linear_weights(model: torch.nn.Module) -> tuple[dict[str, torch.nn.Linear], set[int]]:
    """The model's Linear modules by name, and the storages shared by two parameter names
    (tied weights: merging into one would change the other)."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    seen: dict[int, str] = {}
    tied: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        ptr = p.data_ptr()
        if ptr in seen and seen[ptr] != name:
            tied.add(ptr)
        seen.setdefault(ptr, name)
    return linears, tied


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise LoRAError(f"{directory}: no {CONFIG_FILE} (a regular file) in the adapter "
                        "directory")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise LoRAError(f"{CONFIG_FILE}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoRAError(f"{CONFIG_FILE}: not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{CONFIG_FILE}: must be a JSON object")
    return config


def _check_config(config: dict[str, Any], max_rank: int | None) -> tuple[int, float]:
    """(r, scale) of a peft LoRA config; LoRAError naming the field it cannot apply."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"{CONFIG_FILE}: peft_type {peft_type!r} is not LORA")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise LoRAError(f"{CONFIG_FILE}: r must be a positive integer, got {r!r}")
    if max_rank is not None and r > max_rank:
        raise LoRAError(f"{CONFIG_FILE}: r = {r} is larger than --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", 8)  # peft's default
    if (not isinstance(alpha, (int, float)) or isinstance(alpha, bool)
            or not math.isfinite(alpha)):
        raise LoRAError(f"{CONFIG_FILE}: lora_alpha must be a finite number, got {alpha!r}")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoRAError(f"{CONFIG_FILE}: use_rslora must be a boolean, got {rslora!r}")
    for key, why in _REFUSED_CONFIG.items():
        if config.get(key) not in (None, False, [], {}, ""):
            raise LoRAError(f"{CONFIG_FILE}: {key} = {config[key]!r}: {why} by the built-in "
                            "engine")
    bias = config.get("bias", "none")
    if bias != "none":
        raise LoRAError(f"{CONFIG_FILE}: bias = {bias!r}: only 'none' is supported (trained "
                        "biases are not part of the merge)")
    if config.get("fan_in_fan_out", False) is not False:
        raise LoRAError(f"{CONFIG_FILE}: fan_in_fan_out = {config['fan_in_fan_out']!r}: only "
                        "false (torch Linear layout) is supported")
    scale = alpha / math.sqrt(r) if rslora else alpha / r
    return r, float(scale)


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        pickles = [p for p in PICKLE_FILES if (directory / p).exists()]
        if pickles:
            raise LoRAError(f"{directory}: only {pickles[0]} (a pickle) is there: the built-in "
                            f"engine reads no pickle; save the adapter as {WEIGHTS_FILE} "
                            "(peft's save_pretrained default, safe_serialization=True)")
        raise LoRAError(f"{directory}: no {WEIGHTS_FILE} (a regular file) in the adapter "
                        "directory")
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except Exception as e:  # a malformed header or truncated data: SafetensorError and others
        raise LoRAError(f"{WEIGHTS_FILE}: cannot be read: {type(e).__name__}: {e}") from None


def read_adapter(name: str, path: Any, model: torch.nn.Module, *, max_rank: int | None,
                 target_modules: set[str] | None) -> Adapter:
    """Read and check the adapter at `path` against `model`; nothing of the model changes.
    LoRAError names the field, file or key that is wrong."""
    if not isinstance(path, str) or not path:
        raise LoRAError(f"lora_path must be a non-empty string, got {path!r}")
    directory = Path(path)
    if not directory.is_dir():
        raise LoRAError(f"lora_path {path!r} is not an existing directory")
    rank, scale = _check_config(_read_config(directory), max_rank)
    tensors = _read_tensors(directory)
    linears, tied = _linear_weights(model)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(f"{WEIGHTS_FILE}: key {key!r} is not a LoRA factor "
                            "(base_model.model.<module>.lora_A.weight or .lora_B.weight)")
        module = m["module"]
        linear = linears.get(module)
        if linear is None:
            raise LoRAError(f"{WEIGHTS_FILE}: key {key!r}: {module!r} is not a Linear module "
                            "of the model")
        short = module.rsplit(".", 1)[-1]
        if target_modules is not None and "all" not in target_modules \
                and short not in target_modules:
            raise LoRAError(f"{WEIGHTS_FILE}: key {key!r}: module {short!r} is not in "
                            f"--lora-target-modules {sorted(target_modules)}")
        if linear.weight.data_ptr() in tied:
            raise LoRAError(f"{WEIGHTS_FILE}: key {key!r}: {module!r}'s weight is tied to "
                            "another parameter; merging into it would change both")
        if not t.dtype.is_floating_point:
            raise LoRAError(f"{WEIGHTS_FILE}: key {key!r}: dtype {t.dtype} is not a floating "
                            "type")
        out_features, in_features = linear.weight.shape
        expected = (rank, in_features) if m["ab"] == "A" else (out_features, rank)
        if tuple(t.shape) != expected:
            raise LoRAError(f"{WEIGHTS_FILE}: key {key!r}: shape {list(t.shape)}, expected "
                            f"{list(expected)} (r = {rank}, {module} is "
                            f"[{out_features}, {in_features}])")
        if not bool(torch.isfinite(t).all()):
            raise LoRAError(f"{WEIGHTS_FILE}: key {key!r}: holds values that are not finite")
        halves.setdefault(module, {})[m["ab"]] = t
    if not halves:
        raise LoRAError(f"{WEIGHTS_FILE}: no LoRA factors in the file")
    adapter = Adapter(name=name, path=path, rank=rank, scale=scale)
    for module, pair in sorted(halves.items()):
        missing = {"A", "B"} - set(pair)
        if missing:
            raise LoRAError(f"{WEIGHTS_FILE}: base_model.model.{module}.lora_"
                            f"{missing.pop()}.weight is missing (every lora_A needs its lora_B)")
        adapter.factors[module] = (pair["A"], pair["B"])
    return adapter


class LoRAState:
    """The adapter merged into one model (at most one), the host copy of the base values of
    the weights it changed, and the names ever loaded. `merge` and `restore` run on the
    scheduler thread; the event loop reads `merged` to check requests."""

    def __init__(self, *, enabled: bool, max_rank: int | None,
                 target_modules: set[str] | None) -> None:
        self.enabled = enabled
        self.max_rank = max_rank
        self.target_modules = target_modules
        self.merged: Adapter | None = None
        self.known: dict[str, str] = {}  # every name loaded since start -> its latest path
        self._base: dict[str, torch.Tensor] = {}  # Linear module name -> base weight (host)
        self._spare: dict[str, torch.Tensor] = {}  # the buffers of the last unload, for reuse

    @property
    def name(self) -> str | None:
        return self.merged.name if self.merged else None

    def loaded_adapters(self) -> dict[str, str]:
        return {self.merged.name: self.merged.path} if self.merged else {}

    def merge(self, model: torch.nn.Module, adapter: Adapter) -> int:
        """W += scale * B @ A (float32, then cast) for every module; the base values kept.
        A failure half-way restores what was changed. Returns the number of weights."""
        assert self.merged is None, "restore the merged adapter first"
        linears = dict(model.named_modules())
        try:
            with torch.no_grad():
                for module, (a, b) in adapter.factors.items():
                    w = linears[module].weight
                    kept = self._spare.pop(module, None)  # last load's buffer: no new pages
                    if kept is None or kept.shape != w.shape or kept.dtype != w.dtype:
                        kept = torch.empty(w.shape, dtype=w.dtype, device="cpu")
                    self._base[module] = kept.copy_(w.detach())
                    a32, b32 = a.to(w.device, torch.float32), b.to(w.device, torch.float32)
                    if w.dtype == torch.float32:  # one pass, no temporary of W's size
                        w.addmm_(b32, a32, alpha=adapter.scale)
                    else:
                        w.copy_(torch.addmm(w.float(), b32, a32, alpha=adapter.scale))
        except BaseException:
            self.restore(model)
            raise
        self.merged = adapter
        self.known[adapter.name] = adapter.path
        return len(adapter.factors)

    def restore(self, model: torch.nn.Module) -> int:
        """Put back the base values of every weight the merge changed, exactly."""
        linears = dict(model.named_modules())
        with torch.no_grad():
            for module, base in self._base.items():
                linears[module].weight.copy_(base)
        n = len(self._base)
        self._spare = self._base  # reused by the next merge (a sync unloads, then loads)
        self._base = {}
        self.merged = None
        return n

    # ---- requests ----
    def check_request(self, lora: Any) -> None:
        """BadRequest unless a client request naming `lora` (None: no adapter) can be served
        now; a name loaded before and unloaded since passes (`admissible` decides later)."""
        if lora is None:
            if self.merged is not None:
                raise BadRequest(
                    f"LoRA adapter {self.merged.name!r} is merged into the built-in engine's "
                    f"weights: every request must name it (lora_path {self.merged.name!r}); "
                    "the built-in engine serves one merged adapter and cannot serve the base "
                    "model meanwhile")
            return
        if not self.enabled:
            raise BadRequest(
                f"LoRA adapter '{lora}' was requested, but LoRA is not enabled. Please launch "
                "the server with --enable-lora flag and preload adapters using --lora-paths or "
                "/load_lora_adapter endpoint.")
        if lora not in self.known:
            raise BadRequest(f"Got LoRA adapter that has never been loaded: {lora}\n"
                             f"All loaded adapters: {_keys_repr(self.known)}.")
        if self.merged is not None and self.merged.name != lora:
            raise BadRequest(
                f"LoRA adapter {lora!r} is not loaded: the built-in engine serves one merged "
                f"adapter at a time, and {self.merged.name!r} is the one merged now")

    def admissible(self, lora: str | None) -> str | None:
        """(scheduler thread, at admission) Why a queued request cannot run with the weights
        as they are now; None when it can."""
        if lora == self.name:
            return None
        if lora is None:
            return (f"LoRA adapter {self.name!r} was merged while this request waited; it "
                    "names no adapter, and the built-in engine serves one merged adapter")
        if self.merged is None:
            return (f"LoRA adapter {lora!r} was unloaded and not loaded again before this "
                    "request was admitted")
        return (f"LoRA adapter {lora!r} is not loaded: {self.name!r} is the one merged now "
                "(the built-in engine serves one merged adapter at a time)")


def _result(success: bool, error: str, state: LoRAState | None) -> web.Response:
    """SGLang's LoRAUpdateOutput as its HTTP route sends it (msgspec_to_builtins: BaseReq's
    `rid` and `http_worker_ipc` first, both null), 200 or 400. `error_message` is "" on
    success (LoRAManager.create_lora_update_result); `loaded_adapters` is {name: path} from the
    engine, null when SGLang's tokenizer manager refuses before asking it (`state` None)."""
    return web.json_response({"rid": None, "http_worker_ipc": None, "success": success,
                              "error_message": error,
                              "loaded_adapters": None if state is None
                              else state.loaded_adapters()},
                             status=200 if success else 400)


class LoRARoutes:
    """/load_lora_adapter and /unload_lora_adapter of one EngineServer (server.py)."""

    def __init__(self, server: Any, state: LoRAState) -> None:
        self.server = server
        self.state = state

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_post("/load_lora_adapter", self.load_lora_adapter)
        router.add_post("/unload_lora_adapter", self.unload_lora_adapter)

    @staticmethod
    def _name(body: dict[str, Any], key: str) -> str:
        value = body.get(key)
        if not isinstance(value, str):
            raise MalformedBody(f"{key} is required: a string, got {value!r}")
        return value

    def _busy(self, s: Any) -> str | None:
        """Why the weights cannot change now (scheduler thread), or None."""
        if "weights" in s.memory_released:
            return ("the weights are released (/release_memory_occupation): resume them "
                    "(/resume_memory_occupation) before changing the LoRA adapter")
        clients = [r for r in s.running if not r.internal]
        if clients:
            return (f"{len(clients)} requests are running: the built-in engine merges the "
                    "adapter into its weights, so it changes adapters only while none runs "
                    "(pause generation in abort mode first)")
        return None

    async def load(self, name: str, path: Any) -> tuple[str, bool] | None:
        """Load and merge: None on success, else (the error message, whether the engine
        side refused it: SGLang then lists the loaded adapters)."""
        state = self.state
        if not state.enabled:
            return NOT_ENABLED, False
        error = await self._load(name, path)
        return None if error is None else (error, True)

    async def _load(self, name: str, path: Any) -> str | None:
        state = self.state
        if state.merged is not None and state.merged.name == name:
            return f"Failed to load LoRA adapter {name} because it is already loaded"
        if state.merged is not None:
            return (f"Failed to load LoRA adapter {name}: the built-in engine holds one adapter "
                    f"at a time, merged into its weights, and {state.merged.name!r} is loaded; "
                    "unload it first")
        model = self.server.model

        def load(s: Any) -> int:
            if (why := self._busy(s)) is not None:
                raise LoRAError(why)
            if state.merged is not None:  # another load got in first
                raise LoRAError(f"Failed to load LoRA adapter {name}: {state.merged.name!r} "
                                "is loaded; unload it first")
            start = time.perf_counter()
            adapter = read_adapter(name, path, model, max_rank=state.max_rank,
                                   target_modules=state.target_modules)
            s.weights_changing()  # prefix cache cleared, fused decode copies rebuilt
            n = state.merge(model, adapter)
            self.server.log.info("lora_loaded", name=name, path=path, rank=adapter.rank,
                                 scale=adapter.scale, weights=n,
                                 seconds=round(time.perf_counter() - start, 3))
            return n

        try:
            await self.server.scheduler_call("call", load)
        except LoRAError as e:
            self.server.log.warning("lora_load_failed", name=name, path=path, error=str(e))
            return str(e)
        return None

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        b = await read_body(request)
        name, path = self._name(b, "lora_name"), self._name(b, "lora_path")
        failed = await self.load(name, path)
        if failed is None:
            return _result(True, "", self.state)
        return _result(False, failed[0], self.state if failed[1] else None)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        b = await read_body(request)
        name = self._name(b, "lora_name")
        state = self.state
        if not state.enabled:
            return _result(False, NOT_ENABLED, None)
        if state.name != name:  # SGLang's LoRARegistry.unregister, before the engine is asked
            return _result(False, f"LoRA with name {name} does not exist. Loaded LoRAs: "
                                  f"{_keys_repr(state.loaded_adapters())}", None)

        def unload(s: Any) -> int:
            if state.name != name:
                raise LoRAError(f"LoRA with name {name} does not exist. Loaded LoRAs: "
                                f"{_keys_repr(state.loaded_adapters())}")
            if (why := self._busy(s)) is not None:
                raise LoRAError(why)
            s.weights_changing()
            n = state.restore(self.server.model)
            self.server.log.info("lora_unloaded", name=name, weights=n)
            return n

        try:
            await self.server.scheduler_call("call", unload)
        except LoRAError as e:
            self.server.log.warning("lora_unload_failed", name=name, error=str(e))
            return _result(False, str(e), state)
        return _result(True, "", state)

    def refuse_weight_update(self) -> str | None:
        """Why a full weight update is refused now (an adapter merged), or None."""
        if self.state.merged is None:
            return None
        return (f"LoRA adapter {self.state.merged.name!r} is merged into the weights: a full "
                "weight update would leave its kept base copy stale; unload it first "
                "(/unload_lora_adapter)")
