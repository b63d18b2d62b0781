#!/usr/bin/env bash
# Issue 32's GPU checks, sized for a lent machine (about 8 minutes on one H100/H200):
#   1. tests/gpu (LoRA on CUDA: the trainer's adapters in bf16 with the base frozen and the
#      reference the base model; the built-in engine on CUDA serving an adapter as peft decodes
#      it, both decode backends; and the earlier trainer/engine/sync checks);
#   2. benchmarks/lora.py --device cuda at the Qwen2.5-0.5B shape: bytes and seconds per sync,
#      LoRA r16 beside full weights (goals: <= 3% of the bytes, <= 0.1x the seconds), and the
#      trainer step's time and peak memory (max_memory_allocated; goal: LoRA <= 0.6x full).
# Figures and logs go under $OUT (default /tmp/gpu_lora). Run from the repository root:
#   OUT=/tmp/out bash benchmarks/gpu_lora.sh
# The interpreter is $PY (default .venv/bin/python): torch with CUDA, transformers, peft,
# pyzmq, msgpack, structlog, numpy, aiohttp.
set -u
OUT=${OUT:-/tmp/gpu_lora}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/device.txt" 2>&1
timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/gpu -rs > "$OUT/gpu_tests.log" 2>&1
echo "tests/gpu rc=$?" | tee -a "$OUT/device.txt"
tail -3 "$OUT/gpu_tests.log"
timeout 260 "$PY" benchmarks/lora.py --device cuda --shape 0.5b --rank 16 --seqs 16 \
    --prompt 128 --response 512 --repeats 3 --root /tmp/rollmesh-bench \
    --json "$OUT/lora_gpu.json" > "$OUT/lora_gpu.log" 2>&1
echo "lora.py rc=$?" | tee -a "$OUT/device.txt"
tail -8 "$OUT/lora_gpu.log"
