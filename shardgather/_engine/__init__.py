"""The engine: plan -> transport -> sink (``run``), and the load path back (``load``).

Transports: ``node_local`` (each rank writes its own pieces), ``remote`` (pieces of
ranks on other hosts, to rank 0), ``collective`` (buckets). Sinks: ``sinks`` (host
dict, files, stream) and ``load.Shards``. Scheduling from the plan alone: ``buckets``,
``pieces``. Pinned staging: ``staging``.
"""
