#!/usr/bin/env bash
# Set up, then gather a real sharded model (FSDP1 and FSDP2, 2 gloo processes) with
# shardgather and with torch's own paths, and print time / peak RSS side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 bench/bench_gather.py --size-gb "${SIZE_GB:-0.25}" --world 2 --repeats 1 "$@"
