#!/usr/bin/env bash
# Set up rollmesh in a virtual environment on this host (idempotent).
#   bash launch/bootstrap.sh            # runtime
#   bash launch/bootstrap.sh --test     # runtime + test tools
#   bash launch/bootstrap.sh --sglang   # runtime + SGLang (GPU inference hosts)
# On a host without an NVIDIA GPU it installs the CPU build of torch, never the CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${ROLLMESH_VENV:-.venv}
extras=""
for arg in "$@"; do
  case "$arg" in
    --test) extras="${extras:+$extras,}test" ;;
    --sglang) extras="${extras:+$extras,}sglang" ;;
    *) echo "bootstrap.sh: unknown option $arg (expected --test or --sglang)" >&2; exit 2 ;;
  esac
done
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip() { "$venv/bin/python" -m pip "$@"; }
torch_version=2.13.0
torch_check='import torch'
# SGLang pins an exact torch (launch/sglang-requirements.txt): with --sglang, that one, replacing
# another version already in the venv.
sglang_torch_version=2.14.1
case ",$extras," in
  *,sglang,*)
    torch_version=$sglang_torch_version
    torch_check="import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$torch_version')"
    ;;
esac
if ! "$venv/bin/python" -c "$torch_check" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install "torch==$torch_version"
  else
    # A local CPU wheel if the host has one, else PyTorch's CPU index.
    pip install "torch==$torch_version+cpu" \
      || pip install --index-url https://download.pytorch.org/whl/cpu "torch==$torch_version"
  fi
fi
pip install -e ".${extras:+[$extras]}"
case ",$extras," in
  # The worked example of a custom agent loop, registered through its entry point; the tests
  # run a dataset row that names it.
  *,test,*) pip install --no-deps -e tests/packages/rollmesh_example_loop ;;
esac
echo "rollmesh installed in $venv"
