"""How long each rank takes to raise when one rank fails, is stuck or dies in the middle
of a save, and what a call costs in rounds — the failure workers of
``tests/test_failures.py``, timed.

    python bench/bench_failures.py [--json out.json]

2 gloo ranks, FSDP2 TinyLM, rank 1 the faulty one. "raises": an exception in its third
bucket (collective), while planning its buckets, or writing its pieces (node-local),
timeout 60 s. "stuck": 9 s asleep with a 4 s timeout. "dies": ``os._exit`` with a 20 s
timeout. Seconds from the call to the raise, per rank (None: the rank died).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import dist_harness


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out: dict = {}

    def run(name: str, worker: str, **kw) -> list:  # type: ignore[no-untyped-def,type-arg]
        with tempfile.TemporaryDirectory() as d:
            rs = dist_harness.run(
                f"tests.test_failures:{worker}",
                2,
                timeout=240,
                path=os.path.join(d, "m.safetensors"),
                **kw,
            )
        out[name] = rs
        return rs

    for where in ["collective", "plan", "node-local"]:
        run(f"raises: {where} (timeout 60 s)", "raises_mid_save_worker", where=where)
    for transport in ["collective", "node-local"]:
        run(
            f"stuck: {transport} (timeout 4 s, 9 s asleep)",
            "stuck_mid_save_worker",
            transport=transport,
        )
        run(
            f"dies: {transport} (timeout 20 s)",
            "dies_mid_save_worker",
            transport=transport,
            _allow_missing=(1,),
        )
    counts = run("rounds", "counting_worker")[0]
    print(f"{'scenario':45s} {'rank 0 s':>9s} {'rank 1 s':>9s}  raised (rank 0)")
    for name, rs in out.items():
        if name == "rounds":
            continue
        spent = [None if r is None else round(r["spent"], 3) for r in rs]
        print(f"{name:45s} {spent[0]!s:>9s} {spent[1]!s:>9s}  {rs[0]['raised']}")
    print("rounds per call (first, then repeated), torch collectives in brackets:")
    for verb, calls in counts.items():
        print(f"  {verb:26s} " + " ".join(f"{c['rounds']} ({c['torch']})" for c in calls))
    if args.json:
        slim = {
            k: v
            if k == "rounds"
            else [None if r is None else {"raised": r["raised"], "spent_s": r["spent"]} for r in v]
            for k, v in out.items()
        }
        slim["command"] = "python " + " ".join(sys.argv)
        Path(args.json).write_text(json.dumps(slim, indent=1))


if __name__ == "__main__":
    main()
