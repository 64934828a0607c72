"""Tokens a trainer processes for the same rollouts in tree mode versus path mode.

Path mode repeats a shared prefix in every sample through it; tree mode packs each tree once.
Workloads (the generator of bench_streams_core.py, 200-token deltas, 100-token completions):
- branching: 20 turns, every 5th turn retried twice, a rewind after turn 12 to turn 6;
- retry_heavy: 20 turns, every turn retried 3 times (best-of-4 sampling at each step);
- long_rewinds: 60 turns, the context rewound to turn 2 after turns 19 and 39 (summarize).
Figures: input tokens (all, and trained = loss-masked), the ratio path / tree, and a dense
attention cost proxy (sum of n^2 over samples).

    .venv/bin/python bench/bench_tree_vs_path.py [--quick]

Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_streams_core import make_rollout

from rollstream.schemas.events import Trajectory
from rollstream.streams.core import SampleConfig, build_samples, replay

WORKLOADS: dict[str, dict[str, Any]] = {
    "branching": {"turns": 20},
    "retry_heavy": {"turns": 20, "retry_every": 1, "retries": 3, "rewinds": {}},
    "long_rewinds": {"turns": 60, "retry_every": 10**9, "rewinds": {19: 2, 39: 2}},
}


def compare(trajectories: list[Trajectory]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("path", "tree"):
        samples = [s for t in trajectories for s in build_samples(t, SampleConfig(mode=mode))]
        out[mode] = {
            "samples": len(samples),
            "tokens": sum(s.num_tokens for s in samples),
            "trained_tokens": int(sum(int(s.loss_mask.sum()) for s in samples)),
            "attention_n2": sum(s.num_tokens**2 for s in samples),
        }
    path, tree = out["path"], out["tree"]
    out["token_ratio"] = round(path["tokens"] / tree["tokens"], 3)
    out["trained_token_ratio"] = round(path["trained_tokens"] / tree["trained_tokens"], 3)
    out["attention_ratio"] = round(path["attention_n2"] / tree["attention_n2"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller run, under 30 s")
    args = parser.parse_args()
    rollouts = 8 if args.quick else 64
    rng = np.random.default_rng(0)
    result: dict[str, Any] = {"bench": "tree_vs_path", "quick": args.quick, "rollouts": rollouts}
    for name, shape in WORKLOADS.items():
        events: list[Any] = []
        carried = 0
        for i in range(rollouts):
            rollout, n = make_rollout(rng, f"{name}-{i}", "g", branching=True, **shape)
            events += rollout
            carried += n
        trajectories = [o for o in replay(events)[1] if isinstance(o, Trajectory)]
        result[name] = {"event_tokens": carried, **compare(trajectories)}
        r = result[name]
        print(
            f"{name:12s} path {r['path']['tokens']:>9d} tokens  tree {r['tree']['tokens']:>9d}"
            f"  ratio {r['token_ratio']:.2f}  (trained {r['trained_token_ratio']:.2f},"
            f" attention n^2 {r['attention_ratio']:.2f})"
        )
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
