#!/usr/bin/env bash
# Set up everything from the repository's own files, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m ruff check shardgather tests bench
OMP_NUM_THREADS=1 python3 -m pytest -q -p no:cacheprovider --timeout 600 tests "$@"
