#!/usr/bin/env bash
# GPU check of the attention kernels (under 8 minutes on an H200): CUDA kernel tests (every
# backend against the float64 reference, recompilation counted in autotune keys), then the
# benchmark at seed-like lengths with Qwen3-8B shapes (32 query heads, 8 KV heads, head dim 128,
# bf16). Configs are pinned (DFLASH_PIN_CONFIGS=1: the first config that fits and does not spill,
# no autotuning), which keeps compiling inside the budget; the JSON records it. Needs only torch
# and triton (+ pytest); matplotlib is optional (PNG chart).
#   bash launch/gpu_check.sh OUT_DIR   -> OUT_DIR/log.txt, bench_kernels.json, bench_kernels.png
set -uo pipefail
OUT=${1:?usage: launch/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
cd "$(dirname "$0")/.."
exec > >(tee -a "$LOG") 2>&1
echo "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
# Editable install without dependencies or the C++ extension; the repo root on PYTHONPATH is
# the fallback when pip cannot install (no network, no setuptools).
DFLASH_NO_EXT=1 pip install --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || echo "pip install failed: using PYTHONPATH=$(pwd)"
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
export DFLASH_PIN_CONFIGS=1
echo "== kernel tests (CUDA, pinned configs)"
timeout 240 python -m pytest tests/ops -q -p no:cacheprovider --ignore=tests/ops/test_compile_kernels.py
TESTS=$?
echo "== benchmark"
timeout 200 python launch/bench_kernels.py --quick --out "$OUT"
BENCH=$?
echo "== done: tests rc=$TESTS, benchmark rc=$BENCH"
exit $(( TESTS != 0 || BENCH != 0 ))
