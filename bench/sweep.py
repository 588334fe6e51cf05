"""Time and peak memory vs model size: runs bench_gather.py per size, writes one JSON
and a PNG (time and peak RSS rise of rank 0 / rank 1 vs size, per method).

    python bench/sweep.py --sizes 0.25 0.5 1 2 --world 2 --out bench/results/cpu-sweep
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=float, default=[0.25, 0.5, 1.0, 2.0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--fsdp", default="fsdp1")
    ap.add_argument("--ops", nargs="+", default=["gather", "save", "load"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results" / "cpu-sweep"))
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = []
    for size in args.sizes:
        js = out.with_name(f"{out.name}-{size:g}gb.json")
        cmd = [
            sys.executable,
            str(HERE / "bench_gather.py"),
            "--size-gb",
            str(size),
            "--world",
            str(args.world),
            "--fsdp",
            args.fsdp,
            "--repeats",
            str(args.repeats),
            "--ops",
            *args.ops,
            "--json",
            str(js),
        ]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)
        runs.append({"size_gb": size, **json.loads(js.read_text())})
        js.unlink()
    summary = {"command": "python " + " ".join(sys.argv), "runs": runs}
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2))
    plot(runs, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [r["method"] for r in runs[0]["results"]]
    ops = sorted({m.split("/", 1)[1].split(":")[0] for m in methods})
    fig, axes = plt.subplots(3, len(ops), figsize=(5.2 * len(ops), 11), squeeze=False)
    sizes = [r["size_gb"] for r in runs]
    for col, op in enumerate(ops):
        for m in [m for m in methods if m.split("/", 1)[1].startswith(op)]:
            rows = [next(x for x in r["results"] if x["method"] == m) for r in runs]
            label = m.split(": ", 1)[1]
            style = {"lw": 2.5} if "shardgather" in label else {"ls": "--"}
            axes[0][col].plot(sizes, [x["time_s"] for x in rows], marker="o", label=label, **style)
            for rank in (0, 1):
                # Rank 0 also counts the node's /dev/shm rise: the node-local output
                # lives there, where no RSS shows it.
                shm = [x.get("peak_shm_rise_node", 0) if rank == 0 else 0 for x in rows]
                axes[1 + rank][col].plot(
                    sizes,
                    [(x["peak_rss_rise_per_rank"][rank] + m) / 2**30 for x, m in zip(rows, shm)],
                    marker="o",
                    label=label,
                    **style,
                )
        axes[0][col].set_title(f"{op}: wall time")
        axes[1][col].set_title(f"{op}: peak RSS rise + /dev/shm rise, rank 0")
        axes[2][col].set_title(f"{op}: peak RSS rise, rank 1")
        axes[0][col].set_ylabel("seconds")
        axes[1][col].set_ylabel("GiB")
        axes[2][col].set_ylabel("GiB")
        for r in range(3):
            axes[r][col].set_xlabel("model size (GiB fp32)")
            axes[r][col].grid(alpha=0.3)
        axes[0][col].legend(fontsize=7)
    fig.suptitle(
        f"shardgather vs torch, {runs[0]['config']['fsdp'][0]}, world "
        f"{runs[0]['config']['world']}, {runs[0]['machine']['cpus']} CPUs (gloo)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--replot":
        src = Path(sys.argv[2])
        plot(json.loads(src.read_text())["runs"], src.with_suffix(".png"))
    else:
        main()
