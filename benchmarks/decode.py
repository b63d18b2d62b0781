"""Built-in engine decode vs transformers `generate`, same batch, same device, same run.

    python benchmarks/decode.py [--device cpu|cuda] [--model tiny:...|PATH] [--requests 32]
                                [--new-tokens 128] [--json PATH]

Both decode `--requests` prompts (8-40 tokens) for `--new-tokens` greedy tokens. The engine
side runs the Scheduler's own admission and decode step (`_admit`, `_decode_step`) on this
thread, once with the fast path (decoder.py; CUDA graphs on CUDA) and once with the HF path,
so each step can be timed (synchronised on CUDA); `generate` gets the same prompts left-padded
in one batch, its steps timed by a logits processor. Reported: tokens/s over the whole decode
(prefill included), the median per-step ms, and aten ops and host syncs per step (counted by a
TorchDispatchMode over separate, untimed steps). Goals (issue 31): fast >= 1.0x generate on
CPU, >= 5x on a GPU at the Qwen2.5-0.5B shape, which `benchmarks/real_scale.py` writes:

    PYTHONPATH=$PWD .venv/bin/python -c "from pathlib import Path; \
        from benchmarks.real_scale import write_checkpoint as w; w(Path('/tmp/q05'))"
    PYTHONPATH=$PWD .venv/bin/python benchmarks/decode.py --device cuda --model /tmp/q05
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results import row, write  # noqa: E402
from rollmesh.engine.builtin.sampling import SamplingParams  # noqa: E402
from rollmesh.engine.builtin.scheduler import Request, Scheduler  # noqa: E402
from rollmesh.models.loading import load_model  # noqa: E402

CPU_DEFAULT = "tiny:hidden=256,layers=4,heads=8,kv_heads=2"
SYNC_OPS = ("_local_scalar_dense", "item", "is_nonzero", "nonzero", "equal")


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = func.__name__.split(".")[0]
        # A copy from an accelerator to the host waits for it, as a scalar read does.
        if name in SYNC_OPS or (name == "_to_copy" and args and args[0].device.type == "cuda"
                                and (kwargs or {}).get("device") == torch.device("cpu")):
            self.syncs += 1
        return func(*args, **(kwargs or {}))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(5, min(vocab, 2000), (8 + (i * 7) % 33,), generator=g).tolist()
            for i in range(n)]


def _requests(ids: list[list[int]], new: int) -> list[Request]:
    return [Request(rid=f"r{i}", input_ids=p, max_new_tokens=new, on_progress=lambda _r: None,
                    params=SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=new))
            for i, p in enumerate(ids)]


def engine(model: Any, tok: Any, ids: list[list[int]], new: int, backend: str,
           device: torch.device) -> dict[str, Any]:
    s = Scheduler(model, tok, weight_version="0", max_running_requests=len(ids), seed=0,
                  decode_backend=backend)
    steps: list[float] = []
    with torch.inference_mode():
        for warm in (True, False):  # the first pass captures graphs / warms allocators
            reqs = _requests(ids, new)
            _sync(device)
            start = time.perf_counter()
            s.waiting.extend(reqs)
            s._admit()
            while s.running:
                t = time.perf_counter()
                s._decode_step()
                _sync(device)
                if not warm:
                    steps.append(time.perf_counter() - t)
            wall = time.perf_counter() - start
        outputs = [r.output_ids for r in reqs]
        s.waiting.extend(_requests(ids, new))
        s._admit()
        s._decode_step()
        count = Count()
        with count:
            for _ in range(4):
                s._decode_step()
        s._finish_all({"type": "abort"})
    return {"tps": len(ids) * new / wall, "step_ms": 1e3 * statistics.median(steps),
            "ops": count.ops / 4, "syncs": count.syncs / 4, "outputs": outputs}


def generate(model: Any, ids: list[list[int]], new: int, device: torch.device,
             pad: int) -> dict[str, Any]:
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

    width = max(len(p) for p in ids)
    x = torch.tensor([[pad] * (width - len(p)) + p for p in ids], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids], device=device)
    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            _sync(device)
            stamps.append(time.perf_counter())
            return scores

    def run(n: int, *, stamp: bool = False) -> torch.Tensor:
        config = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=pad, eos_token_id=None)
        extra = {"logits_processor": LogitsProcessorList([Stamp()])} if stamp else {}
        return model.generate(input_ids=x, attention_mask=mask, generation_config=config,
                              **extra)

    with torch.no_grad():
        run(4)
        _sync(device)
        start = time.perf_counter()
        out = run(new, stamp=True)
        _sync(device)
        wall = time.perf_counter() - start
        counts = []
        for n in (4, 8):
            c = Count()
            with c:
                run(n)
            counts.append(c)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"tps": len(ids) * new / wall, "step_ms": 1e3 * statistics.median(gaps),
            "ops": (counts[1].ops - counts[0].ops) / 4,
            "syncs": (counts[1].syncs - counts[0].syncs) / 4,
            "outputs": out[:, width:].tolist()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", default=None, help=f"tiny spec or checkpoint dir (CPU default: "
                                                 f"{CPU_DEFAULT})")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3,
                   help="timed passes of each side, interleaved; the best one is reported (this "
                        "machine's CPUs are shared: the best pass is the least disturbed)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (the engine's own default for a tiny model: 1)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    model, tok = load_model(args.model or CPU_DEFAULT, device, dtype)
    ids = prompts(args.requests, model.config.vocab_size)
    pad = model.config.pad_token_id or 0
    runs: dict[str, list[dict[str, Any]]] = {"fast": [], "hf": [], "generate": []}
    for _ in range(args.repeats):
        runs["fast"].append(engine(model, tok, ids, args.new_tokens, "fast", device))
        runs["hf"].append(engine(model, tok, ids, args.new_tokens, "hf", device))
        runs["generate"].append(generate(model, ids, args.new_tokens, device, pad))
    fast, hf_path, gen = (max(runs[k], key=lambda r: r["tps"]) for k in ("fast", "hf", "generate"))
    same = sum(a == b for a, b in zip(fast["outputs"], gen["outputs"]))
    for name, r in (("engine fast", fast), ("engine hf", hf_path), ("generate", gen)):
        print(f"{name:12s} {r['tps']:9.0f} tokens/s  {r['step_ms']:7.2f} ms/step  "
              f"{r['ops']:6.0f} aten ops/step  {r['syncs']:4.1f} host syncs/step")
    print(f"fast/generate {fast['tps'] / gen['tps']:.2f}x; greedy outputs equal to generate: "
          f"{same}/{len(ids)} ({dtype})")
    note = (f"best of {args.repeats}; {args.requests} x {args.new_tokens} greedy tokens, {args.model or CPU_DEFAULT}, "
            f"{dtype}; per step fast {fast['step_ms']:.2f} ms, {fast['ops']:.0f} ops, "
            f"{fast['syncs']:.1f} syncs; generate {gen['step_ms']:.2f} ms, {gen['ops']:.0f} ops, "
            f"{gen['syncs']:.1f} syncs")
    target = 5.0 if device.type == "cuda" else 1.0
    write(args.json, [
        row(f"built-in engine decode tokens/s on {device.type} (fast path)", fast["tps"],
            gen["tps"], "tokens/s", baseline_name="transformers generate, same batch and device",
            higher_is_better=True, target=target, note=note),
        row(f"built-in engine decode tokens/s on {device.type} (HF path)", hf_path["tps"],
            gen["tps"], "tokens/s", baseline_name="transformers generate, same batch and device",
            higher_is_better=True, note=note)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
