#!/usr/bin/env bash
# One prepared run for a machine with a GPU (e.g. the device tool's H200): build against
# the torch already installed there, run the CUDA tests, the op bench and the gather bench
# (NCCL, world = number of GPUs), measure the pinned-copy peak, write everything to $OUT.
# Keep it under ~8 minutes.
#
# --cpu-dry-run (CI, tests/test_gpu_check.py): every step with CPU stand-ins, so the
# device minutes go to measuring — no build or install, the CUDA tests collected (and
# each CUDA path below found among them), the benches on tiny sizes with gloo.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[[ "${1:-}" == "--cpu-dry-run" ]] && DRY=1
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/gpu_check.log"; }
CUDA_TESTS="tests/test_ops.py tests/test_cuda.py tests/test_one_device.py"
# Every CUDA code path and the test that runs it on the GPU (a pytest id substring).
CUDA_PATHS=(
  "copy_out and copy_in kernels, every cast|test_cuda_copy_out_matches_cpu"
  "N-D strided blocks (TP, FSDP2 x TP)|test_cuda_strided_blocks_match_cpu"
  "pinned staging: a pageable destination refused|test_cuda_rejects_pageable_cpu_destination"
  "diff_update kernel (weight-sync deltas)|test_cuda_diff_update_matches_cpu"
  "gather, bf16 cast, save, load of CUDA shards, node-local|test_gather_save_load_on_gpu[auto"
  "gather, save, load of CUDA shards, collective buckets|test_gather_save_load_on_gpu[collective"
  "async snapshot: copy kernel on a side stream|test_async_save_on_gpu_holds_the_values_at_call_time"
  "HF save, load, stream device=cuda, checkpoint resume (FSDP1)|test_every_verb_on_one_device[cuda-fsdp1"
  "HF save, load, stream device=cuda, checkpoint resume (FSDP2)|test_every_verb_on_one_device[cuda-fsdp2"
  "weight-sync deltas of CUDA shards (FSDP1)|test_weight_sync_deltas_of_shards_on_one_device[cuda-fsdp1"
  "weight-sync deltas of CUDA shards (FSDP2)|test_weight_sync_deltas_of_shards_on_one_device[cuda-fsdp2"
)
{
  nvidia-smi || true
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
} > "$OUT/env.txt" 2>&1
if [[ $DRY == 1 ]]; then
  log "dry run: the CUDA tests collected"
  python3 -m pytest -q --collect-only -m cuda $CUDA_TESTS -p no:cacheprovider > "$OUT/cuda_tests.txt" 2>&1
  missing=0
  for entry in "${CUDA_PATHS[@]}"; do
    what="${entry%%|*}"; test_id="${entry#*|}"
    if ! grep -qF -- "$test_id" "$OUT/cuda_tests.txt"; then
      log "MISSING: no CUDA test for '$what' ($test_id)"; missing=1
    fi
  done
  [[ $missing == 0 ]] || { tail -20 "$OUT/cuda_tests.txt"; exit 1; }
  log "dry run: the op bench"
  timeout 300 python3 bench/bench_ops.py --device cpu --mb 4 --world 2 --json "$OUT/cpu-ops.json" \
    > "$OUT/bench_ops.txt" 2>&1 || { log "op bench FAILED"; tail -20 "$OUT/bench_ops.txt"; exit 1; }
  log "dry run: the gather bench"
  timeout 300 python3 bench/bench_gather.py --backend gloo --world 2 --size-gb 0.02 --repeats 1 \
    --json "$OUT/cpu-gather.json" > "$OUT/bench_gather.txt" 2>&1 \
    || { log "gather bench FAILED"; tail -20 "$OUT/bench_gather.txt"; exit 1; }
  log "dry run OK: ${#CUDA_PATHS[@]} CUDA paths, each with its test"
  exit 0
fi
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
timeout 300 python3 -m pytest -q -rs -m cuda $CUDA_TESTS $TIMEOUT_ARG 2>&1 | tail -40 | tee "$OUT/pytest_cuda.txt"
log "op bench"
timeout 120 python3 bench/bench_ops.py --device cuda --json "$OUT/gpu-ops.json" 2>&1 | tail -30 | tee "$OUT/bench_ops.txt"
log "gather bench"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
timeout 240 python3 bench/bench_gather.py --backend nccl --world "$NGPU" --size-gb "${SIZE_GB:-4}" \
  --repeats 3 --json "$OUT/gpu-gather.json" 2>&1 | grep -v Warning | tail -20 | tee "$OUT/bench_gather.txt"
log "done"
