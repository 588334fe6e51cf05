#!/usr/bin/env bash
# Install the pinned stack and build shardgather in place. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -r requirements-dev.txt
python3 -m pip install -q --no-deps -r requirements-nodeps.txt
DS_BUILD_OPS=0 python3 -m pip install -q --no-build-isolation -r requirements-sdist.txt
# With nvcc on PATH the CUDA kernels must build: a compile failure fails the setup.
if [[ -z "${SHARDGATHER_CUDA:-}" ]] && command -v nvcc >/dev/null 2>&1; then
  export SHARDGATHER_CUDA=1
fi
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;9.0}"
export MAX_JOBS="${MAX_JOBS:-2}"
python3 -m pip install -q --no-build-isolation -e .
python3 -c "import shardgather, json; print('shardgather build:', json.dumps(shardgather.build_info()))"
if [[ "${SHARDGATHER_CUDA:-}" == "1" ]]; then
  python3 -c "import shardgather, sys; sys.exit(0 if shardgather.build_info()['with_cuda'] else 'CUDA kernels were not built')"
fi
