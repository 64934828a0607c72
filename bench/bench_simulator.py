"""The simulator's table: every workload x every policy (median of 3 seeds), the speedup of
each over sync, and each paper's policy against its published figure (the calibration error).

Pure Python, no services: ``--quick`` runs half the steps and one seed (under 30 s on two
cores).
``--plot PATH`` writes the speedup / utilisation plot of the whole table.

    python bench/bench_simulator.py [--quick] [--seeds N] [--workloads a,b] [--plot PATH]

The last line is one JSON object: per workload and policy the speedup, steady s/step,
utilisation (rollout, train), waste and staleness p50/max; per paper workload the published and
simulated speedups of its policy and their relative error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console

from rollstream.consumers.control.sim import POLICY_NAMES, PolicySummary, compare
from rollstream.consumers.control.sim_workloads import WORKLOADS
from rollstream.consumers.control.simulate_cli import table, write_plot


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="half the steps (>= 8), one seed")
    ap.add_argument("--seeds", type=int, help="runs per policy (default 3; --quick: 1)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    names = [n for n in args.workloads.split(",") if n]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        sys.exit(f"unknown workloads {unknown} (known: {', '.join(WORKLOADS)})")
    console = Console(width=140)
    seeds = tuple(range(max(1, args.seeds or (1 if args.quick else 3))))
    started = time.perf_counter()
    by_workload: dict[str, list[PolicySummary]] = {}
    figures: dict[str, object] = {}
    calibration: dict[str, object] = {}
    for name in names:
        w = WORKLOADS[name]
        steps = max(8, w.steps // 2) if args.quick else w.steps
        rows = compare(w, POLICY_NAMES, seeds=seeds, steps=steps)
        by_workload[name] = rows
        console.print(table(w, rows, steps))
        figures[name] = {
            s.policy: {
                "speedup": round(s.speedup or 0.0, 3),
                "step_s": round(s.step_s, 1),
                "util_rollout": round(s.util_rollout, 3),
                "util_train": round(s.util_train, 3),
                "waste": round(s.waste, 3),
                "staleness_p50": s.staleness_p50,
                "staleness_max": s.staleness_max,
                "inference_share": round(s.mean_inference_share, 3),
            }
            for s in rows
        }
        if w.paper_policy and w.published_speedup:
            simulated = next(s.speedup for s in rows if s.policy == w.paper_policy) or 0.0
            best_other = max(
                (s for s in rows if s.policy.startswith("rollstream")),
                key=lambda s: s.speedup or 0.0,
            )
            calibration[name] = {
                "policy": w.paper_policy,
                "published": w.published_speedup,
                "simulated": round(simulated, 3),
                "error": round(simulated / w.published_speedup - 1, 3),
                "rollstream": figures[name]["rollstream"]["speedup"],  # type: ignore[index]
                "best_rollstream": best_other.policy,
            }
    seconds = time.perf_counter() - started
    if args.plot is not None:
        published = {
            n: (WORKLOADS[n].paper_policy or "", WORKLOADS[n].published_speedup or 0.0)
            for n in names
            if WORKLOADS[n].paper_policy and WORKLOADS[n].published_speedup
        }
        console.print(f"plot: {write_plot(by_workload, args.plot, published)}")
    for name, c in calibration.items():
        console.print(
            f"{name}: {c['policy']} simulated {c['simulated']:.2f}x, "  # type: ignore[index]
            f"published {c['published']}x ({c['error']:+.1%})"  # type: ignore[index]
        )
    console.print(
        f"{len(names)} workloads x {len(POLICY_NAMES)} policies x {len(seeds)} seeds "
        f"in {seconds:.1f} s"
    )
    print(
        json.dumps(
            {
                "bench": "simulator",
                "quick": args.quick,
                "seeds": len(seeds),
                "seconds": round(seconds, 1),
                "calibration": calibration,
                "figures": figures,
            }
        )
    )


if __name__ == "__main__":
    main()
