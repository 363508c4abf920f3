#!/usr/bin/env bash
# One-shot GPU check for a lent GPU machine (launch/gpu_check.py: correctness at Qwen3-8B shapes,
# kernel TFLOP/s, the fused drafter ops against their torch paths, then drafter training steps on a
# random Qwen3-8B-shaped target: three batching
# modes, the memory plan against the measured peak, the other drafter kinds' steps): runs with the
# image's python3 and PYTHONPATH=$PWD, installs nothing, needs no network (DeepSpeed comes as
# wheels in wheels/, docs/BENCHMARKS.md); at most 8 minutes on one H200. Each stage writes its
# JSON into OUT as it goes.
#   bash launch/gpu_check.sh OUT [gpu_check.py options]   -> OUT/log.txt, env.json, correctness.json,
#                                                            bench_kernels.json, fused_ops.json, e2e.json, memory.json,
#                                                            <kind>.json per other drafter kind, summary.json
#   bash launch/gpu_check.sh OUT --dry-run                 # tiny shapes on a CPU (Triton interpreter)
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: launch/gpu_check.sh OUT [gpu_check.py options]" >&2; exit 2; }
mkdir -p "$1"
OUT=$(cd "$1" && pwd)
shift
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}  # the image's interpreter; CI's test passes its own
timeout -k 10 480 "$PY" launch/gpu_check.py "$OUT" "$@" 2>&1 | tee -a "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
