#!/usr/bin/env bash
# Set up everything from the repository's own files, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m ruff check shardgather tests bench examples
python3 -m ruff format --check shardgather tests bench
clang-format --dry-run --Werror csrc/*.cpp csrc/*.h csrc/include/shardgather/*.h csrc/cpu/*.cpp csrc/cuda/*.cu
OMP_NUM_THREADS=1 python3 -m pytest -q -p no:cacheprovider --timeout 600 tests "$@"
