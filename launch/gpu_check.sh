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
#   bash launch/gpu_check.sh --help                        # this text and gpu_check.py's options
set -uo pipefail
usage="usage: bash launch/gpu_check.sh OUT [gpu_check.py options] (--help: what it does)"
[ $# -ge 1 ] || { echo "$usage" >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}  # the image's interpreter; CI's test passes its own
case "$1" in
  -h|--help)  # the comment above, then the options gpu_check.py takes after OUT
    sed -n '2,/^set /p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    echo
    PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" "$root/launch/gpu_check.py" --help ;;
  -*) echo "error: OUT $1: the output folder comes first, not an option; $usage" >&2; exit 2 ;;
esac
mkdir -p "$1"
OUT=$(cd "$1" && pwd)
shift
cd "$root"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout -k 10 480 "$PY" launch/gpu_check.py "$OUT" "$@" 2>&1 | tee -a "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
