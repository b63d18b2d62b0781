#!/usr/bin/env bash
# Issue 31's GPU checks, sized for a lent machine (about 8 minutes on one H100/H200):
#   1. tests/gpu (the fast decode path's CUDA graphs against generate, CUDA IPC weight sync
#      into the built-in engine bit for bit and SGLang's payload form, release/resume of GPU
#      memory, and the earlier trainer/engine/sync checks);
#   2. benchmarks/decode.py at the Qwen2.5-0.5B shape: 32 requests x 128 greedy tokens, the
#      engine's fast path vs its HF path vs transformers generate, bf16 (goal: >= 5x generate);
#   3. benchmarks/gpu.py --only sync,launch: one same-GPU sync over gloo and by CUDA IPC beside
#      a raw broadcast and a device-to-device copy (goal: IPC <= 1.5x the copy), then the
#      one-GPU comparison (share_gpus async vs colocated vs sync_mode, samples/s; goal: the
#      better default >= 1.3x today's launch/single_gpu.toml).
# Figures and logs go under $OUT (default /tmp/gpu_one_device). Run from the repository root:
#   OUT=/tmp/out bash benchmarks/gpu_one_device.sh
# The interpreter is $PY (default .venv/bin/python): torch with CUDA, transformers, pyzmq,
# msgpack, structlog, numpy, aiohttp.
set -u
OUT=${OUT:-/tmp/gpu_one_device}
PY=${PY:-.venv/bin/python}
DIR=${DIR:-/tmp/rollmesh-qwen25-05b-random}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/device.txt" 2>&1
timeout 180 "$PY" -m pytest -q -p no:cacheprovider tests/gpu -rs > "$OUT/gpu_tests.log" 2>&1
echo "tests/gpu rc=$?" | tee -a "$OUT/device.txt"
tail -3 "$OUT/gpu_tests.log"
"$PY" -c "from pathlib import Path; from benchmarks.real_scale import write_checkpoint as w; w(Path('$DIR'))" \
    > "$OUT/checkpoint.log" 2>&1
timeout 120 "$PY" benchmarks/decode.py --device cuda --model "$DIR" --dtype bfloat16 \
    --requests 32 --new-tokens 128 --repeats 2 --json "$OUT/decode_gpu.json" \
    > "$OUT/decode_gpu.log" 2>&1
echo "decode rc=$?" | tee -a "$OUT/device.txt"
tail -8 "$OUT/decode_gpu.log"
timeout 240 "$PY" benchmarks/gpu.py --dir "$DIR" --only sync,launch --launch-steps 8 \
    --json "$OUT/gpu_sync_launch.json" > "$OUT/gpu_sync_launch.log" 2>&1
echo "gpu.py sync,launch rc=$?" | tee -a "$OUT/device.txt"
grep -E "^sync|samples/s" "$OUT/gpu_sync_launch.log" | tail -8
