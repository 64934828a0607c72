"""The simulator against this machine: the workload ``bench/bench_async_rl.py`` runs live,
simulated with parameters measured from the live run's service logs, and the wall times
compared (docs/simulator.md, "Validated against this machine").

    python bench/bench_sim_validation.py [--workload bench/this_machine.json] [--live FILE]
                                         [--seeds N] [--steps N] [--logs DIR]
    python bench/bench_sim_validation.py --measure DIR [--write bench/this_machine.json]

Validation (the default): loads the workload JSON, simulates ``sync``, ``fully_async`` and
``rollstream`` for the live run's steps with as many seeds as it had runs (``--seeds``), and
compares each mode's simulated time to the last policy version with the live median
(``to_last_version_s_median``: the last line of ``--live``, a ``bench_async_rl.py`` output;
while that run is still going, the medians of its ``run i MODE: {...}`` lines so far). Modes:
sync -> sync, async -> fully_async, async+controller -> rollstream. The simulated run starts
with its first rollout and ends with the trainer's step N; the live clock starts with the
demo's loop, ``lead_s`` before the first rollout's first event, and stops when the demo sees
the proxy serve version N, ``tail_s`` after the step's log line (in sync the simulated step
also holds the turnaround to the next round, ``switch_s``, which the live run does not wait
for after its last step). The offsets, per mode, are the ``CLOCK`` constants below, or
measured again from ``--logs``.

Measurement (``--measure DIR``, DIR the ``--keep`` folder of ``bench_async_rl.py``: one folder
of service logs per run, named by its namespace) prints each parameter with how it was
measured and writes the workload JSON (``--write``). Nothing is fitted to the wall times.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import re
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from rollstream.consumers.control import SimResult, Workload, simulate, workload_from_json
from rollstream.infra.demo.agent import env_seconds

MODES: Final = {"sync": "sync", "async": "fully_async", "async+controller": "rollstream"}
TOKENS_PER_CALL: Final = 12  # the demo's demo_max_tokens: one model call
TOLERANCE: Final = 0.20
# the live clock around the simulated run (module docstring), measured with --measure from the
# logs of bench_async_rl.py on 2026-12-02 (docs/simulator.md, "Validated against this machine")
CLOCK: Final[dict[str, dict[str, float]]] = {
    "sync": {"lead_s": 3.2, "tail_s": 0.16},
    "async": {"lead_s": 2.43, "tail_s": 1.6},
    "async+controller": {"lead_s": 3.76, "tail_s": 0.63},
}

_TS = re.compile(r"^\[?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]? ")
_CALL = re.compile(
    r"POST http://[^/\s]+/(?:v1/rollouts/(?P<rid>[^/\s]+)/(?P<kind>events|tool_calls|finish)"
    r"|rollouts/(?P<crid>[^/\s]+)/v1/chat/completions)"
)
_STEP = re.compile(r"step (\d+): (\d+) samples, \d+ tokens, loss \S+, ([\d.]+)s")
_QUEUED = re.compile(r"job (\S+): \d+ rollouts queued")


# -- the logs ---------------------------------------------------------------------------------
@dataclass
class Rollout:
    """One rollout's requests to the proxy, as the workers logged their answers (epoch s)."""

    events: list[float] = field(default_factory=list)
    chats: list[float] = field(default_factory=list)
    tools: list[float] = field(default_factory=list)
    finish: list[float] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return bool(self.events and self.finish and self.chats) and len(self.tools) == 2


@dataclass
class RunLog:
    """The service logs of one live run (one namespace)."""

    namespace: str
    mode: str  # sync | async | async+controller
    rollouts: dict[str, Rollout]
    jobs: list[tuple[str, float]]  # (job id, queued at), in time order
    polls: list[float]  # the demo's status polls (its version clock); the first is its t0
    steps: list[tuple[float, int, float]]  # (logged at, samples, compute s) per trainer step
    reloads: list[float]  # the proxy starts reloading version k + 1
    served: list[float]  # the backend answered the load of version k + 1

    def job(self, job: str) -> list[Rollout]:
        return [r for rid, r in self.rollouts.items() if rid.startswith(job + "-")]

    def observed(self, k: int) -> float:
        """When the demo first polled after the proxy served version ``k``."""
        i = bisect.bisect_right(self.polls, self.served[k - 1])
        return self.polls[min(i, len(self.polls) - 1)]


def _ts(line: str) -> float | None:
    m = _TS.match(line)
    if m is None:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _stamped(path: Path) -> list[tuple[float, str]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        t = _ts(line)
        if t is not None:
            out.append((t, line))
    return out


def _mode(namespace: str) -> str | None:
    for prefix, mode in (
        ("benchasynccontroller", "async+controller"),
        ("benchasync", "async"),
        ("benchsync", "sync"),
    ):
        if namespace.startswith(prefix):
            return mode
    return None


def read_run(folder: Path) -> RunLog | None:
    """A run's logs, or None when the folder is not a finished bench_async_rl run."""
    mode = _mode(folder.name)
    if mode is None:
        return None
    rollouts: dict[str, Rollout] = defaultdict(Rollout)
    for t, line in _stamped(folder / "workers.log"):
        m = _CALL.search(line)
        if m is None:
            continue
        rid = m.group("rid") or m.group("crid")
        if not rid.startswith(folder.name + "-"):  # a previous run's rollouts, reaped
            continue
        kind = m.group("kind") or "chats"
        getattr(rollouts[rid], kind if kind != "tool_calls" else "tools").append(t)
    for r in rollouts.values():
        for times in (r.events, r.chats, r.tools, r.finish):
            times.sort()
    demo = _stamped(folder / "demo.log")
    jobs = [(m.group(1), t) for t, line in demo if (m := _QUEUED.search(line))]
    polls = sorted(t for t, line in demo if "/v1/admin/status" in line)
    steps = []
    for t, line in _stamped(folder / "trainer.log"):
        if m := _STEP.search(line):
            steps.append((t, int(m.group(2)), float(m.group(3))))
    proxy = _stamped(folder / "proxy.log")
    reloads = [t for t, line in proxy if "reloading backends" in line]
    served = [t for t, line in proxy if "/v1/load_weights" in line]
    if not (steps and polls and served and len(served) >= len(steps)):
        return None
    return RunLog(
        folder.name,
        mode,
        dict(rollouts),
        sorted(jobs, key=lambda j: j[1]),
        polls,
        steps,
        reloads,
        served,
    )


# -- the measurements -------------------------------------------------------------------------
@dataclass
class Measured:
    """A parameter and how it was measured."""

    value: float
    how: str


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def _calls(run: RunLog) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(calls whose start is known: after a tool call or a previous call, all calls with the
    first one's start estimated) as (start, end); a call's end is its answer."""
    known: list[tuple[float, float]] = []
    firsts: list[float] = []
    for r in run.rollouts.values():
        timeline = sorted(
            [(t, "e") for t in r.events[:1]]
            + [(t, "c") for t in r.chats]
            + [(t, "t") for t in r.tools]
        )
        for (ta, ka), (tb, kb) in itertools.pairwise(timeline):
            if kb == "c":
                if ka in "ct":
                    known.append((ta, tb))
                else:
                    firsts.append(tb)
    typical = _median([b - a for a, b in known])
    return known, known + [(t - typical, t) for t in firsts]


def fit_generation(runs: list[RunLog], base: Workload) -> tuple[Measured, Measured]:
    """peak_tokens_per_s and half_batch of the fluid model, least squares over every model
    call whose start is known: latency = tokens (b + half n) / (peak n), b the calls in flight
    at its midpoint, n the inference accelerators of the mode's policy (sync: all of them)."""
    xs: list[float] = []
    ys: list[float] = []
    split = round(base.inference_share * base.accelerators)  # fully_async, rollstream
    for run in runs:
        n = base.accelerators if run.mode == "sync" else split
        known, every = _calls(run)
        starts, ends = sorted(a for a, _ in every), sorted(b for _, b in every)
        for a, b in known:
            mid = (a + b) / 2
            flight = bisect.bisect_right(starts, mid) - bisect.bisect_right(ends, mid)
            xs.append(TOKENS_PER_CALL * flight / n)
            ys.append(b - a)
    # y = c1 x + c2 k, k = tokens per call: c1 = 1 / peak, c2 = half / peak
    k = float(TOKENS_PER_CALL)
    sxx, sxk, skk = sum(x * x for x in xs), k * sum(xs), k * k * len(xs)
    sxy, sky = sum(x * y for x, y in zip(xs, ys, strict=True)), k * sum(ys)
    det = sxx * skk - sxk * sxk
    c1, c2 = (sxy * skk - sxk * sky) / det, (sxx * sky - sxk * sxy) / det
    how = (
        f"least squares over {len(xs)} model calls of {len(runs)} runs (latency against "
        f"calls in flight); a lone call: {k * (1 + c2 / c1) * c1:.2f} s"
    )
    return Measured(round(1 / c1, 1), how), Measured(round(c2 / c1, 2), how)


def measure(runs: list[RunLog], env: dict[str, float], base: Workload) -> dict[str, Measured]:
    """Every measured workload parameter (docs/simulator.md gives the provenance)."""
    free = [r for r in runs if r.mode != "async+controller"]  # no admission wait inside
    syncs = [r for r in runs if r.mode == "sync"]
    streams = [r for r in runs if r.mode == "async"]
    out: dict[str, Measured] = {}
    out["peak_tokens_per_s"], out["half_batch"] = fit_generation(free, base)
    done = [r for run in free for r in run.rollouts.values() if r.complete]
    calls = sum(len(r.chats) for r in done) / (2 * len(done))
    out["tokens_median"] = Measured(
        round(TOKENS_PER_CALL * calls, 2),
        f"{TOKENS_PER_CALL} tokens x {calls:.3f} model calls per turn (a digit-less answer is "
        f"asked again), {len(done)} rollouts",
    )
    overhead = []
    for run in free:
        typical = _median([b - a for a, b in _calls(run)[0]])
        for rid, r in run.rollouts.items():
            if not r.complete:
                continue
            spent = r.chats[0] - r.events[0] - typical + r.finish[-1] - r.tools[-1]
            for turn, tool in enumerate(r.tools):
                before = [c for c in r.chats if c < tool]
                spent += (
                    tool
                    - before[-1]
                    - env_seconds(rid, turn, env["median_s"], env["sigma"], env["max_s"])
                )
            overhead.append(spent)
    out["rollout_overhead_s"] = Measured(
        round(statistics.fmean(overhead), 3),
        f"mean over {len(overhead)} rollouts of first event -> finish less the model calls and "
        f"the environment time (env_seconds of its id); median {_median(overhead):.2f} s",
    )
    inside = []
    for run in streams:  # a rollout not finished by the last step is inside until then
        t1 = run.steps[-1][0]
        spans = [
            (r.events[0], r.finish[-1] if r.finish else t1)
            for r in run.rollouts.values()
            if r.events
        ]
        t0 = min(b for _, b in spans)
        area = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in spans)
        inside.append(area / (t1 - t0))
    out["rollout_slots"] = Measured(
        round(_median(inside)),
        "rollouts between their first event and their finish, time-weighted mean from the "
        f"first finish to the last step, median of {len(streams)} async runs: "
        + ", ".join(f"{x:.1f}" for x in inside),
    )
    full: dict[str, list[float]] = {m: [] for m in MODES}
    for run in runs:
        full[run.mode] += [c for _, n, c in run.steps if n == base.samples_per_step]
    every = [c for cs in full.values() for c in cs]
    out["train_step_s"] = Measured(
        round(_median(every), 3),
        f"median optimizer step of {len(every)} full steps (trainer.log); by mode: "
        + ", ".join(f"{m} {_median(cs):.2f} s" for m, cs in full.items()),
    )
    fixed, switch, load = [], [], []
    for run in syncs:
        rounds = [run.job(job) for job, _ in run.jobs]
        for k, (logged, _, compute) in enumerate(run.steps):
            fixed.append(logged - max(r.finish[-1] for r in rounds[k] if r.finish) - compute)
            if k + 1 < len(rounds) and rounds[k + 1]:
                switch.append(min(r.events[0] for r in rounds[k + 1]) - logged)
        load += [s - r for r, s in zip(run.reloads, run.served, strict=False)]
    out["train_fixed_s"] = Measured(
        round(_median(fixed), 3),
        f"median over {len(fixed)} sync steps of a round's last finish -> the step's log, less "
        "the optimizer step (processor, checkpoint, publish)",
    )
    out["switch_s"] = Measured(
        round(_median(switch), 3),
        f"median over {len(switch)} sync steps of the step's log -> the next round's first "
        "rollout (reload, the demo's poll, job submission, INIT pick-up)",
    )
    out["weight_sync_s"] = Measured(
        round(_median(load), 3),
        f"median over {len(load)} sync reloads of the proxy's reload -> the backend's answer "
        "(nothing to drain)",
    )
    return out


def measure_clock(runs: list[RunLog]) -> dict[str, dict[str, float]]:
    """lead_s and tail_s per mode (module docstring), medians over its runs."""
    out: dict[str, dict[str, float]] = {}
    for mode in MODES:
        mine = [r for r in runs if r.mode == mode]
        if not mine:
            continue
        lead = [
            min(r.events[0] for r in run.rollouts.values() if r.events) - run.polls[0]
            for run in mine
        ]
        tail = [run.observed(len(run.steps)) - run.steps[-1][0] for run in mine]
        out[mode] = {"lead_s": round(_median(lead), 2), "tail_s": round(_median(tail), 2)}
    return out


def first_step_wait(run: RunLog, base: Workload) -> float:
    """Seconds from the moment the first step's samples were out (the last rollout of its
    groups finished) to the trainer's first step, less the optimizer step: the processor, the
    checkpoint and the trainer's start-up, which the simulator does not model."""
    jobs = [run.job(job) for job, _ in run.jobs]
    done = [max(r.finish[-1] for r in rs) for rs in jobs if rs and all(r.finish for r in rs)]
    per_job = base.groups_per_step if run.mode == "sync" else 1
    ready = sorted(done)[base.groups_per_step // per_job - 1]
    logged, _, compute = run.steps[0]
    return logged - compute - ready


def workload_json(
    params: dict[str, Measured], env: dict[str, float], steps: int, max_staleness: int
) -> dict[str, Any]:
    """The workload file: measured parameters, the bench's settings, the rest from
    ``this_machine``."""
    value = {k: m.value for k, m in params.items()}
    return {
        "base": "this_machine",
        "description": "rollstream demo as bench/bench_async_rl.py runs it (4 tasks x 8 "
        "rollouts, 2 turns, env lognormal), parameters measured from its service logs",
        "rollout_slots": int(value["rollout_slots"]),
        "max_seqs_per_accelerator": 16,
        "peak_tokens_per_s": value["peak_tokens_per_s"],
        "half_batch": value["half_batch"],
        "turns_min": 2,
        "turns_max": 2,
        "tokens_median": value["tokens_median"],
        "tokens_sigma": 0.0,
        "tokens_max": 2 * TOKENS_PER_CALL,
        "env_median_s": env["median_s"],
        "env_sigma": env["sigma"],
        "env_tail_p": 0.0,
        "env_max_s": env["max_s"],
        "rollout_overhead_s": value["rollout_overhead_s"],
        "train_step_s": value["train_step_s"],
        "train_fixed_s": value["train_fixed_s"],
        "train_scaling": 0.0,
        "recompute_logprobs_s": 0.0,
        "switch_s": value["switch_s"],
        "weight_sync_s": value["weight_sync_s"],
        "interrupt_tokens": 0.0,
        "max_staleness": max_staleness,
        "admission_ahead_steps": float(max_staleness),
        "control_period_s": 1.0,
        "steps": steps,
        "source": "bench/bench_sim_validation.py --measure (docs/simulator.md, 'Validated "
        "against this machine')",
    }


# -- the comparison ---------------------------------------------------------------------------
def read_live(path: Path) -> dict[str, Any]:
    """bench_async_rl's result: its last JSON line, else the medians of its run lines so far."""
    lines = path.read_text().splitlines()
    for line in reversed(lines):
        if line.startswith("{"):
            data = json.loads(line)
            if data.get("bench") == "async_rl":
                data["partial"] = False
                return data
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for line in lines:
        if m := re.match(r"run (\d+) (\S+): (\{.*\})$", line):
            runs[m.group(2)].append(json.loads(m.group(3)))
    if not runs:
        raise SystemExit(f"{path}: no bench_async_rl result nor run lines")
    modes = {
        mode: {
            "to_last_version_s_median": _median([r["to_last_version_s"] for r in rs]),
            "to_last_version_s": [r["to_last_version_s"] for r in rs],
            "to_first_version_s_median": _median([r["to_first_version_s"] for r in rs]),
            "steady_s_per_step_median": _median([r["steady_s_per_step"] for r in rs]),
            "stale_dropped_median": _median([r["stale_dropped"] for r in rs]),
        }
        for mode, rs in runs.items()
    }
    return {"runs": min(len(rs) for rs in runs.values()), "modes": modes, "partial": True}


def live_clock(
    result: SimResult, version: int, mode: str, w: Workload, clock: dict[str, dict[str, float]]
) -> float:
    """The simulated time to ``version`` on the live clock (module docstring)."""
    c = clock[mode]
    t = c["lead_s"] + result.step_ends[version - 1] + c["tail_s"]
    return t - w.switch_s if mode == "sync" else t


def compare_modes(
    w: Workload, live: dict[str, Any], seeds: int, steps: int, clock: dict[str, dict[str, float]]
) -> list[dict[str, Any]]:
    rows = []
    for mode, policy in MODES.items():
        if mode not in live["modes"]:
            continue
        runs = [simulate(w, policy, seed=s, steps=steps) for s in range(seeds)]
        last = [live_clock(r, steps, mode, w, clock) for r in runs]
        first = [live_clock(r, 1, mode, w, clock) for r in runs]
        m = live["modes"][mode]
        sim_s, live_s = _median(last), float(m["to_last_version_s_median"])
        ratio = sim_s / live_s
        rows.append(
            {
                "mode": mode,
                "policy": policy,
                "live_s": round(live_s, 1),
                "live_runs_s": m.get("to_last_version_s"),
                "sim_s": round(sim_s, 1),
                "sim_runs_s": [round(x, 1) for x in last],
                "ratio": round(ratio, 3),
                "within": abs(ratio - 1) <= TOLERANCE,
                "live_first_s": m.get("to_first_version_s_median"),
                "sim_first_s": round(_median(first), 1),
                "live_steady_s": m.get("steady_s_per_step_median"),
                "sim_steady_s": round(
                    _median(
                        [(b - a) / max(steps - 1, 1) for a, b in zip(first, last, strict=True)]
                    ),
                    2,
                ),
                "live_stale_dropped": m.get("stale_dropped_median"),
                "sim_stale_dropped": _median([r.rollouts_wasted for r in runs]),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", type=Path, default=Path(__file__).with_name("this_machine.json"))
    ap.add_argument(
        "--live",
        type=Path,
        help="bench_async_rl.py's output (its last JSON line holds the live medians)",
    )
    ap.add_argument("--seeds", type=int, help="simulated runs per mode (default: live runs)")
    ap.add_argument("--steps", type=int, help="policy versions (default: the live run's)")
    ap.add_argument("--logs", type=Path, help="measure the clock offsets from these logs")
    ap.add_argument("--measure", type=Path, help="measure the workload from these logs")
    ap.add_argument("--write", type=Path, help="with --measure: write the workload JSON here")
    args = ap.parse_args()
    live = read_live(args.live) if args.live is not None and args.live.exists() else None
    if args.measure is not None:
        _measure(args, live)
        return
    if live is None:
        raise SystemExit(f"{args.live}: no such file (--live)")
    w = workload_from_json(json.loads(args.workload.read_text()))
    steps = args.steps or int(live.get("steps", w.steps))
    seeds = args.seeds or int(live.get("runs", 3))
    env = live.get("env")
    if env and (env["median_s"], env["sigma"], env["max_s"]) != (
        w.env_median_s,
        w.env_sigma,
        w.env_max_s,
    ):
        print(f"warning: the live run's environment {env} is not the workload's", file=sys.stderr)
    clock = CLOCK
    if args.logs is not None:
        clock = {**CLOCK, **measure_clock(_runs(args.logs))}
    rows = compare_modes(w, live, seeds, steps, clock)
    print(
        f"{'mode':18s} {'policy':12s} {'live s':>8s} {'sim s':>8s} {'ratio':>6s}  +-20%   "
        f"{'v1 live/sim':>12s} {'s/step live/sim':>16s} {'dropped live/sim':>17s}"
    )
    for r in rows:
        print(
            f"{r['mode']:18s} {r['policy']:12s} {r['live_s']:8.1f} {r['sim_s']:8.1f} "
            f"{r['ratio']:6.2f}  {'yes' if r['within'] else 'NO':5s} "
            f"{r['live_first_s']:6.1f}/{r['sim_first_s']:<5.1f} "
            f"{r['live_steady_s']:8.2f}/{r['sim_steady_s']:<7.2f} "
            f"{r['live_stale_dropped']:8.0f}/{r['sim_stale_dropped']:<8.0f}"
        )
    print(
        json.dumps(
            {
                "bench": "sim_validation",
                "workload": str(args.workload),
                "steps": steps,
                "seeds": seeds,
                "live_partial": live["partial"],
                "clock": clock,
                "tolerance": TOLERANCE,
                "modes": rows,
                "all_within": all(r["within"] for r in rows),
            }
        )
    )


def _runs(folder: Path) -> list[RunLog]:
    runs = [r for d in sorted(folder.iterdir()) if d.is_dir() and (r := read_run(d))]
    if not runs:
        raise SystemExit(f"{folder}: no bench_async_rl run logs")
    return runs


def _measure(args: argparse.Namespace, live: dict[str, Any] | None) -> None:
    runs = _runs(args.measure)
    base = workload_from_json({"base": "this_machine"})
    env = (live or {}).get("env") or {"median_s": 1.0, "sigma": 1.0, "max_s": 20.0}
    steps = int((live or {}).get("steps", max(len(r.steps) for r in runs)))
    staleness = int((live or {}).get("max_staleness", 2))
    for run in runs:
        print(
            f"{run.namespace:28s} {run.mode:17s} {len(run.rollouts):4d} rollouts, "
            f"version {len(run.steps)} seen at {run.observed(len(run.steps)) - run.polls[0]:.2f} s"
        )
    params = measure(runs, env, base)
    for name, m in params.items():
        print(f"{name:20s} {m.value:>9}   {m.how}")
    clock = measure_clock(runs)
    print(f"clock {clock}")
    waits = {run.namespace: round(first_step_wait(run, base), 2) for run in runs}
    print(f"first step: samples out -> its log, less the optimizer step: {waits}")
    data = workload_json(params, env, steps, staleness)
    workload_from_json(data)  # valid, or WorkloadError names the field
    if args.write is not None:
        args.write.write_text(json.dumps(data, indent=1) + "\n")
    print(
        json.dumps(
            {
                "bench": "sim_validation_measure",
                "workload": data,
                "clock": clock,
                "first_step_wait_s": waits,
                "runs": [r.namespace for r in runs],
            }
        )
    )


if __name__ == "__main__":
    main()
