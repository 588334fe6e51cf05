"""Framework integrations. Each submodule imports its framework; this package and the
core import none, so ``import shardgather`` works without any of them installed."""
