#!/usr/bin/env python3
"""Does fleetcuda's parallelism limit its speed? `fleetcuda verify` at several --forks and per-host
channel limits (fleetcuda.connectors.ssh.CHANNELS_PER_HOST, patched in-process by trace_fleetcuda.py;
fleetcuda's code is not edited), round-robin, on one benchmark topology, with run.py's measuring.

    sudo .venv/bin/python benchmarks/sweep.py --size 4x16 --repeats 2

Writes benchmarks/results/DATE-sweep-SIZE.json and a table on stdout. Each run's stderr has the
tracer's timeline (benchmarks/work/SIZE/runs/sweep-*/output.txt).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run  # noqa: E402

VARIANTS = {  # name -> trace_fleetcuda.py options
    "forks 8, channels 8 (defaults)": [],
    "forks 2": ["--forks", "2"],
    "forks 4": ["--forks", "4"],
    "forks 16, channels 16": ["--forks", "16", "--channels", "16"],
    "forks 64, channels 16": ["--forks", "64", "--channels", "16"],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="4x16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--recipe", default="recipes/gdn-fastpath.yaml")
    ap.add_argument("--keep-up", action="store_true")
    args = ap.parse_args()
    size = run.Size(args.size)
    priority = run.CpuPriority(10240, -10)
    started = datetime.now(UTC)
    runs: list[dict] = []
    try:
        run.sh(sys.executable, run.LABCTL, "up", "--topology", size.topology)
        run.write_inventory(size)
        plans = run.Plans(size, args.recipe)
        env = run.contenders(size, plans, args.recipe)["fleetcuda-verify"]["env"]
        priority.topology(size)
        for rnd in range(-1, args.repeats):  # round -1: warm-up, not counted
            for name, opts in VARIANTS.items():
                spec = {"argv": [sys.executable, str(run.BENCH / "trace_fleetcuda.py"), *opts, "--", "verify",
                                 args.recipe, "-i", str(size.inventory), "--plain"], "env": env, "cwd": run.REPO}
                tag = f"sweep-{rnd}-{name.split(',')[0].replace(' ', '')}-{len(opts)}"
                r = run.measure(size, plans, "fleetcuda-verify", spec, tag, warmup=False, quiet_wait=10,
                                quiet_threshold=0.15)
                r.update({"variant": name, "round": rnd})
                text = (size.dir / "runs" / tag / "output.txt").read_text()
                summary = next((ln[8:] for ln in text.splitlines() if ln.startswith("SUMMARY ")), None)
                r["trace"] = json.loads(summary) if summary else None
                runs.append(r)
                run.log(f"  {rnd} {name:32s} {r['wall_s']:6.2f}s {'ERROR ' + r['error'] if r['error'] else ''}")
    finally:
        if not args.keep_up:
            run.sh(sys.executable, run.LABCTL, "down", "--topology", size.topology, check=False)
        priority.close()
    table = {}
    for name in VARIANTS:
        good = [r for r in runs if r["variant"] == name and r["round"] >= 0 and not r["error"]]
        chans = [r["trace"]["channel_ms_min_median_max"][1] for r in good if r["trace"]]
        table[name] = {"median_s": round(statistics.median([r["wall_s"] for r in good]), 2) if good else None,
                       "runs": len(good), "channel_median_ms": statistics.median(chans) if chans else None,
                       "machine_cpu_s": statistics.median([r["machine_cpu_s"] for r in good]) if good else None}
    out = run.RESULTS / f"{started.strftime('%Y-%m-%d')}-sweep-{size.spec}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"started": started.isoformat(timespec="seconds"), "size": size.spec, "machine": run.machine(),
           "repeats": args.repeats, "table": table, "runs": runs, "cpu_priority": priority.describe(),
           "total_s": round(time.time() - started.timestamp(), 1)}
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print("| variant | median s | runs | median time of one container's channel, ms | machine CPU s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, t in table.items():
        print(f"| {name} | {t['median_s']} | {t['runs']} | {t['channel_median_ms']} | {t['machine_cpu_s']} |")
    run.log(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
