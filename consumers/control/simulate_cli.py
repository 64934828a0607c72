"""``rollstream simulate``: run the simulator (sim.py) on a workload and show the policies side
by side: a rich table and, with a path, a PNG plot (speedup and accelerator utilisation).

    SimulateSettings                 workload (a built-in name or a JSON file), policies, seeds,
                                     samples to train, plot path, JSON output
    load_workload(spec) -> Workload  a built-in name, or a JSON file ({"base": NAME, ...})
    run(settings, console) -> int    0, or 2 for a workload or setting that cannot be used
    write_plot(by_workload, path)    the plot (also used by bench/bench_simulator.py)

A JSON workload file overrides a built-in one field by field, e.g. this machine measured:
``{"base": "this_machine", "rollout_slots": 8, "env_median_s": 1.2, "env_sigma": 0.9,
"train_step_s": 1.5, "weight_sync_s": 2.0}`` (fields: sim_workloads.Workload).
The plot needs matplotlib (the ``sink`` extra); the table needs rich (``cli``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rollstream.consumers.control.errors import ControlError, WorkloadError
from rollstream.consumers.control.sim import POLICY_NAMES, PolicySummary, simulate, summarise
from rollstream.consumers.control.sim_workloads import WORKLOADS, Workload, workload_from_json

__all__ = ["SimulateSettings", "load_workload", "run", "write_plot"]

MAX_WORKLOAD_BYTES = 1_000_000


class SimulateSettings(BaseModel):
    """``rollstream simulate``; every field bounded."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    workload: Annotated[str, Field(min_length=1, max_length=4096)] = "this_machine"
    policies: Annotated[list[str], Field(min_length=1, max_length=16)] = list(POLICY_NAMES)
    seeds: Annotated[int, Field(ge=1, le=50)] = 3  # runs per policy (seeds 0 .. seeds - 1)
    samples: Annotated[int, Field(ge=1, le=100_000_000)] | None = None  # None: workload.steps
    plot: Path | None = None  # write the PNG here
    json_output: bool = False  # print one JSON object instead of the table

    @field_validator("policies")
    @classmethod
    def _known(cls, policies: list[str]) -> list[str]:
        unknown = [p for p in policies if p not in POLICY_NAMES]
        if unknown:
            raise ValueError(f"unknown policies {unknown} (known: {', '.join(POLICY_NAMES)})")
        return list(dict.fromkeys(policies))


def load_workload(spec: str) -> Workload:
    """A built-in workload by name, or one read from a JSON file."""
    if spec in WORKLOADS:
        return WORKLOADS[spec]
    path = Path(spec)
    if not path.is_file():
        known = ", ".join(sorted(WORKLOADS))
        raise WorkloadError(f"{spec!r} is neither a workload ({known}) nor a file", field="name")
    if path.stat().st_size > MAX_WORKLOAD_BYTES:
        raise WorkloadError(f"{path} is larger than {MAX_WORKLOAD_BYTES} bytes")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WorkloadError(f"cannot read {path}: {exc}") from exc
    if isinstance(data, dict) and "name" not in data and "base" not in data:
        data = {**data, "name": path.stem.lower().replace("-", "_")[:64] or "workload"}
    return workload_from_json(data)


def _steps(workload: Workload, samples: int | None) -> int:
    return workload.steps if samples is None else math.ceil(samples / workload.samples_per_step)


def _run_all(
    workload: Workload, policies: Sequence[str], seeds: int, steps: int, console: Console
) -> list[PolicySummary]:
    runs = list(dict.fromkeys(["sync", *policies]))
    results: dict[str, list[Any]] = {p: [] for p in runs}
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task(f"simulating {workload.name}", total=len(runs) * seeds)
        for policy in runs:
            for seed in range(seeds):
                results[policy].append(simulate(workload, policy, seed=seed, steps=steps))
                progress.advance(task)
    return [summarise(results[p], results["sync"]) for p in policies]


def table(workload: Workload, summaries: Sequence[PolicySummary], steps: int) -> Table:
    """The rich table of one workload's summaries."""
    title = f"{workload.name}: {steps} steps of {workload.samples_per_step} samples"
    if workload.paper_policy and workload.published_speedup:
        title += f" (published: {workload.paper_policy} {workload.published_speedup:g}x)"
    out = Table(title=title, title_justify="left")
    for name in ("policy", "s/step", "wall", "speedup", "util", "rollout", "train", "waste"):
        out.add_column(name, justify="left" if name == "policy" else "right")
    out.add_column("staleness p50/max", justify="right")
    out.add_column("share", justify="right")
    for s in summaries:
        out.add_row(
            s.policy,
            f"{s.step_s:.1f}",
            _duration(s.wall_s),
            "-" if s.speedup is None else f"{s.speedup:.2f}x",
            f"{s.util:.0%}",
            f"{s.util_rollout:.0%}",
            f"{s.util_train:.0%}",
            f"{s.waste:.1%}",
            f"{s.staleness_p50}/{s.staleness_max}",
            f"{s.mean_inference_share:.2f}",
        )
    out.caption = (
        "speedup: sync's s/step over the policy's (steady state, median of seeds); util: busy "
        "accelerator time (rollout + train); waste: rollouts dropped as stale; share: mean "
        "share of accelerators serving inference"
    )
    return out


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


def write_plot(
    by_workload: Mapping[str, Sequence[PolicySummary]],
    path: Path,
    published: Mapping[str, tuple[str, float]] | None = None,
) -> Path:
    """Speedup over sync and utilisation (rollout / train) per policy, grouped by workload;
    ``published`` marks each workload's published figure (policy, speedup)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(by_workload)
    policies = list(dict.fromkeys(s.policy for rows in by_workload.values() for s in rows))
    width = 0.8 / max(len(policies), 1)
    fig, (ax_speed, ax_util) = plt.subplots(2, 1, figsize=(max(7, 1.6 * len(names) + 3), 7))
    try:
        for i, policy in enumerate(policies):
            xs, speed, roll, train = [], [], [], []
            for j, name in enumerate(names):
                row = next((s for s in by_workload[name] if s.policy == policy), None)
                if row is None:
                    continue
                xs.append(j - 0.4 + width * (i + 0.5))
                speed.append(row.speedup or 0.0)
                roll.append(row.util_rollout)
                train.append(row.util_train)
            color = f"C{i}"
            ax_speed.bar(xs, speed, width, label=policy, color=color)
            ax_util.bar(xs, roll, width, color=color, alpha=0.55)
            ax_util.bar(xs, train, width, bottom=roll, color=color, hatch="//", edgecolor="white")
        for j, name in enumerate(names):
            if published and name in published:
                policy, value = published[name]
                ax_speed.hlines(value, j - 0.45, j + 0.45, colors="black", linestyles="dashed")
                ax_speed.annotate(
                    f"{policy} published {value:g}x",
                    (j, value),
                    fontsize=7,
                    ha="center",
                    va="bottom",
                )
        tallest = [s.speedup or 0.0 for rows in by_workload.values() for s in rows]
        tallest += [value for _, value in (published or {}).values()]
        ax_speed.set_ylim(0, max([1.0, *tallest]) * 1.4)  # room for the legend
        ax_speed.axhline(1.0, color="grey", linewidth=0.8)
        ax_speed.set_ylabel("speedup over sync")
        ax_speed.legend(fontsize=8, ncols=3, loc="upper left")
        ax_util.set_ylabel("busy accelerators (rollout, train //)")
        ax_util.set_ylim(0, 1)
        for ax in (ax_speed, ax_util):
            ax.set_xticks(range(len(names)), names)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def run(settings: SimulateSettings, console: Console | None = None) -> int:
    """Simulate every policy of ``settings`` on its workload; 0, or 2 on a bad workload."""
    console = console or Console()
    try:
        workload = load_workload(settings.workload)
        steps = _steps(workload, settings.samples)
        if steps > 100_000:
            raise WorkloadError(f"{steps} steps (max 100000)", field="samples")
        summaries = _run_all(workload, settings.policies, settings.seeds, steps, console)
    except ControlError as exc:
        console.print(f"[red]rollstream simulate: {exc}[/red]")
        return 2
    if settings.json_output:
        print(
            json.dumps(
                {
                    "workload": workload.to_json(),
                    "steps": steps,
                    "seeds": settings.seeds,
                    "policies": [s.to_json() for s in summaries],
                }
            )
        )
    else:
        console.print(table(workload, summaries, steps))
    if settings.plot is not None:
        published = None
        if workload.paper_policy and workload.published_speedup:
            published = {workload.name: (workload.paper_policy, workload.published_speedup)}
        where = write_plot({workload.name: summaries}, settings.plot, published)
        if not settings.json_output:
            console.print(f"plot: {where}")
    return 0
