"""The GPU figures: rollmesh on one CUDA device, each beside a baseline measured in the same run.

    python benchmarks/gpu.py [--dir DIR] [--only engine,train,sync,launch] [--requests 32]
        [--new-tokens 128] [--seqs 8] [--tokens 512] [--launch-steps 20] [--json PATH]
    python benchmarks/gpu.py --device cpu --small        # a smoke run of the script itself

    engine  built-in engine decode tokens/s on CUDA (bf16, KV cache on the GPU) for --requests
            greedy requests x --new-tokens, all at once, vs transformers `generate` of the same
            batch on the same GPU;
    train   trainer tokens/s of one step (`prepare` + `update_policy`, bf16 autocast over float32
            master weights, 1 rank) vs a plain transformers step (forward, cross-entropy,
            backward, AdamW) on the same tokens, the batch in one pass as the plain step takes
            it, and again in passes of 2 x --tokens (trainer.micro_batch_tokens); peak GPU
            memory of each;
    sync    one weight sync CUDA trainer -> CUDA engine on the same GPU, the real path (gather,
            HTTP, the engine's load): over gloo through host memory (NCCL refuses two ranks on
            one device) vs one raw gloo broadcast of the same bytes, and by handle (CUDA IPC,
            sync.transport = "handles") vs one device-to-device copy of the same bytes;
    launch  benchmarks/one_device.py on this GPU: samples/s consumed by the trainer over
            --launch-steps steps with engine and trainer on the one GPU three ways: share_gpus
            async (launch/single_gpu.toml, the baseline), colocated
            (launch/single_gpu_colocated.toml) and the synchronous baseline (sync_mode).

The model is Qwen2.5-0.5B's shape with random weights (benchmarks/real_scale.py writes it once
into --dir); --small uses the random `tiny` model instead. Needs CUDA unless --device cpu.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import real_scale  # noqa: E402
from benchmarks.engine_proc import start_engine  # noqa: E402
from benchmarks.results import row, write  # noqa: E402

GIB = 2**30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else float("nan")


def _dtype(device: torch.device) -> str:
    return "bfloat16" if device.type == "cuda" else "float32"


def part_engine(args: argparse.Namespace, device: torch.device) -> list[dict]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    prompts = real_scale.prompts(args.requests)
    # --decode-backend fast: the slot-cache step (CUDA graphs on CUDA); refused, not silently
    # replaced by the HF path, if the checkpoint cannot take it.
    proc, url = start_engine("--model", str(args.dir), "--device", device.type, "--dtype",
                             _dtype(device), "--decode-backend", "fast",
                             python=sys.executable, timeout_s=600)
    try:
        wall = asyncio.run(real_scale.generate_all(url, prompts, args.new_tokens))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    engine_tps = args.requests * args.new_tokens / wall

    model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=getattr(torch, _dtype(device)),
                                                 attn_implementation="sdpa").to(device).eval()
    pad = model.config.pad_token_id or 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    config = GenerationConfig(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                              do_sample=False, pad_token_id=pad, eos_token_id=None)
    with torch.no_grad():
        model.generate(input_ids=ids[:1], attention_mask=mask[:1], generation_config=config)
        _sync(device)
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        _sync(device)
    hf_tps = args.requests * args.new_tokens / (time.perf_counter() - start)
    del model
    print(f"engine: {engine_tps:.0f} tokens/s, generate {hf_tps:.0f} tokens/s", flush=True)
    return [row(f"engine decode tokens/s on {device.type}", engine_tps, hf_tps, "tokens/s",
                baseline_name="transformers generate, the same batch on the same device",
                higher_is_better=True,
                note=f"{args.requests} x {args.new_tokens} greedy tokens, {_dtype(device)}")]


def part_train(args: argparse.Namespace, device: torch.device) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from rollmesh.training.state import build_state
    from rollmesh.training.step import prepare, update_policy

    data = real_scale.batch(args.seqs, args.tokens)
    tokens = args.seqs * args.tokens

    def ours(micro_batch_tokens: int) -> tuple[float, float]:
        """One rollmesh step's seconds and peak memory, with this micro-batch budget."""
        exp = real_scale.experiment(args.dir, f'trainer.device="{device.type}"',
                                    f'model.dtype="{_dtype(device)}"',
                                    f"trainer.micro_batch_tokens={micro_batch_tokens}")
        state = build_state(exp, device=device)
        update_policy(state, prepare(state, data))  # warm-up: kernels, allocator, optimizer
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        _sync(device)
        start = time.perf_counter()
        update_policy(state, prepare(state, data))
        _sync(device)
        out = time.perf_counter() - start, _peak(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        return out

    # the whole batch in one pass, as the plain step takes it; then in passes of two sequences
    # (what the figure of 2026-11-24 measured: four passes, each a quarter of the GPU's work)
    whole, whole_mem = ours(tokens)
    split, split_mem = ours(args.tokens * 2)

    model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.float32,
                                                 attn_implementation="sdpa").to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    mb = {k: v.to(device) for k, v in data.rows(list(range(data.size))).items()}

    def plain() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=mb["tokens"], attention_mask=mb["attention_mask"]).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, mb["tokens"][:, 1:, None])
        mask = mb["mask"][:, 1:]
        (-(logp[..., 0] * mask).sum() / mask.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()

    plain()
    _sync(device)
    start = time.perf_counter()
    plain()
    _sync(device)
    base, base_mem = time.perf_counter() - start, _peak(device)
    print(f"train: {tokens / whole:.0f} tokens/s in one pass (peak {whole_mem:.2f} GiB), "
          f"{tokens / split:.0f} in passes of {args.tokens * 2} tokens (peak {split_mem:.2f} "
          f"GiB); plain {tokens / base:.0f} tokens/s (peak {base_mem:.2f} GiB)", flush=True)
    rows = []
    for label, seconds, mem, passes in (("", whole, whole_mem, "one pass, as the plain step"),
                                        (f", passes of {args.tokens * 2} tokens", split,
                                         split_mem, f"micro_batch_tokens={args.tokens * 2}")):
        note = (f"{args.seqs} x {args.tokens} tokens, 1 rank, {passes}; the rollmesh step also "
                f"recomputes the old log-probs; peak GPU memory rollmesh {mem:.2f} GiB, plain "
                f"{base_mem:.2f} GiB")
        rows.append(row(f"trainer tokens/s on {device.type}{label}", tokens / seconds,
                        tokens / base, "tokens/s",
                        baseline_name="plain transformers step + torch AdamW (autocast bf16)",
                        higher_is_better=True, note=note))
    return rows


def part_sync(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """One weight sync trainer -> engine on the same device, both transports: the weight-update
    group over gloo (through host memory) beside one raw gloo broadcast, and by handle (CUDA
    IPC; shared memory on CPU) beside one device-to-device copy of the same bytes."""
    from rollmesh.training.state import build_state
    from rollmesh.training.weight_sender import WeightSender
    from rollmesh.wire.transport import Transport

    rows = []
    for transport in ("broadcast", "handles"):
        exp = real_scale.experiment(args.dir, f'trainer.device="{device.type}"',
                                    f'model.dtype="{_dtype(device)}"',
                                    f'sync.transport="{transport}"')
        state = build_state(exp, device=device)
        proc, url = start_engine("--model", str(args.dir), "--device", device.type, "--dtype",
                                 _dtype(device), python=sys.executable, timeout_s=600)

        async def two_syncs() -> tuple[float, int]:
            with Transport() as t:
                publisher = WeightSender(t, {"engines": [url],
                                             "synchronizer": "tcp://127.0.0.1:9"},
                                         exp.sync, device)
                await publisher.open()
                try:  # the first builds the group (broadcast) or the buffer (handles)
                    await publisher.broadcast(state.model, state.compute_dtype, 1)
                    start = time.perf_counter()
                    sent = await publisher.broadcast(state.model, state.compute_dtype, 2)
                    return time.perf_counter() - start, sent
                finally:
                    await publisher.close()

        try:
            seconds, sent = asyncio.run(two_syncs())
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        if transport == "broadcast":
            floor = real_scale.floor_broadcast(args, sent)
            what, base = "over gloo", "one raw gloo broadcast of the same bytes"
        else:
            floor = _copy_floor(device, sent)
            what = "by handle (CUDA IPC)" if device.type == "cuda" else "by handle (shared memory)"
            base = f"one {'device-to-device' if device.type == 'cuda' else 'memcpy'} copy of " \
                   "the same bytes"
        print(f"sync {transport}: {seconds:.3f} s for {sent / 1e9:.2f} GB, floor {floor:.3f} s",
              flush=True)
        rows.append(row(f"weight sync trainer -> engine on one {device.type} device {what}",
                        seconds, floor, "s", baseline_name=base, higher_is_better=False,
                        target=1.5 if transport == "handles" else None,
                        note=f"{sent / 1e9:.2f} GB {_dtype(device)}, the real path (HTTP, the "
                             "engine's load), a sync after the first"))
    return rows


def _copy_floor(device: torch.device, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def part_launch(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """benchmarks/one_device.py on this GPU: share_gpus async (launch/single_gpu.toml),
    colocated (launch/single_gpu_colocated.toml) and sync_mode, samples/s side by side."""
    if device.type != "cuda":
        print("launch: skipped (launch/single_gpu.toml places the engine on CUDA; "
              "benchmarks/one_device.py --device cpu is the CPU comparison)")
        return []
    from benchmarks import one_device

    sets = (["model.path=tiny"] if args.small
            else [f"model.path={args.dir}", "model.max_context=1024"])
    return one_device.compare("cuda", args.launch_steps, sets)


PARTS = {"engine": part_engine, "train": part_train, "sync": part_sync, "launch": part_launch}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path("/tmp/rollmesh-qwen25-05b-random"))
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--small", action="store_true", help="the tiny model, for a smoke run")
    p.add_argument("--only", default=",".join(PARTS))
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--launch-steps", type=int, default=20)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu.py: CUDA is not available on this host (--device cpu for a smoke "
              "run of the script)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if args.small:
        from rollmesh.models.loading import materialize

        args.dir = materialize("tiny", Path(tempfile.mkdtemp()) / "tiny")
        args.requests, args.new_tokens, args.seqs, args.tokens = 4, 8, 2, 64
    else:
        real_scale.write_checkpoint(args.dir)
    # real_scale's helpers read these
    args.threads = 2
    rows: list[dict] = []
    for name in args.only.split(","):
        if name not in PARTS:
            p.error(f"--only: unknown part {name!r} (expected some of {list(PARTS)})")
        rows += PARTS[name](args, device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    for r in rows:
        r["note"] = f"{name}; {r['note']}"
    write(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
