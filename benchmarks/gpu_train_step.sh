#!/usr/bin/env bash
# The trainer's GPU checks, sized for a lent machine (about 8 minutes, one H100/H200):
#   1. tests/gpu (the packed step against the padded path on CUDA, the compiled head, the bf16
#      step, the engine and the sync on CUDA);
#   2. benchmarks/train_step.py on CUDA at the Qwen2.5-0.5B shape, RL-shaped and equal lengths,
#      rollmesh's step beside a plain transformers step, each in its own process.
# Figures and logs go under $OUT (default /tmp/gpu_train_step). Run from the repository root:
#   OUT=/tmp/out bash benchmarks/gpu_train_step.sh
# The interpreter is $PY (default .venv/bin/python); it needs torch with CUDA, transformers,
# pyzmq, msgpack, structlog and numpy.
set -u
OUT=${OUT:-/tmp/gpu_train_step}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/device.txt" 2>&1
timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/gpu -rs > "$OUT/gpu_tests.log" 2>&1
echo "tests/gpu rc=$?" | tee -a "$OUT/device.txt"
tail -3 "$OUT/gpu_tests.log"
timeout 330 "$PY" benchmarks/train_step.py --device cuda --shape 0.5b --seqs "${SEQS:-8}" \
    --repeats 3 --json "$OUT/train_step_gpu.json" > "$OUT/train_step_gpu.log" 2>&1
echo "train_step rc=$?" | tee -a "$OUT/device.txt"
grep -A12 "^figure" "$OUT/train_step_gpu.log"
