#!/usr/bin/env bash
# One prepared run for a machine with a GPU (e.g. the device tool's H200): build against
# the torch already installed there, run the CUDA tests, the op bench and the gather bench
# (NCCL, world = number of GPUs), measure the pinned-copy peak, write everything to $OUT.
# Keep it under ~8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/gpu_check.log"; }
{
  nvidia-smi || true
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
} > "$OUT/env.txt" 2>&1
log "build"
python3 -m pip install -q safetensors tqdm ninja pytest pytest-timeout >> "$OUT/gpu_check.log" 2>&1 || log "pip install failed (offline?); using what is installed"
CAP=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability(0))")
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$CAP}" SHARDGATHER_CUDA=1 MAX_JOBS="${MAX_JOBS:-8}"
if ! python3 -m pip install -q --no-build-isolation -e . >> "$OUT/build.log" 2>&1; then
  log "BUILD FAILED"; tail -50 "$OUT/build.log"; exit 1
fi
python3 -c "import shardgather, json; print(json.dumps(shardgather.build_info()))" | tee "$OUT/build_info.json"
log "cuda tests"
# The GPU machine may have no package index: use pytest-timeout only where installed.
TIMEOUT_ARG=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 120" || true)
timeout 240 python3 -m pytest -q -m cuda tests/test_ops.py tests/test_cuda.py $TIMEOUT_ARG 2>&1 | tail -30 | tee "$OUT/pytest_cuda.txt"
log "op bench"
timeout 120 python3 bench/bench_ops.py --device cuda --json "$OUT/gpu-ops.json" 2>&1 | tail -30 | tee "$OUT/bench_ops.txt"
log "gather bench"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
timeout 240 python3 bench/bench_gather.py --backend nccl --world "$NGPU" --size-gb "${SIZE_GB:-4}" \
  --repeats 3 --json "$OUT/gpu-gather.json" 2>&1 | grep -v Warning | tail -20 | tee "$OUT/bench_gather.txt"
log "done"
