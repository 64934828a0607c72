"""The simulator (rollstream.consumers.control.sim): runs are deterministic per seed; sync
trains everything fresh and wastes nothing; the bounded policies never train staler than their
bound; rollouts are conserved; each paper's policy lands within 15% of its published speedup on
its workload (computed here); rollstream's policy is ahead of the best of them on each (seed 0);
workloads and the CLI validate what they are given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError
from rich.console import Console

from rollstream.consumers.control import (
    POLICY_NAMES,
    WORKLOADS,
    ControlError,
    Workload,
    WorkloadError,
    simulate,
    workload_from_json,
)
from rollstream.consumers.control.sim_engine import Engine
from rollstream.consumers.control.sim_rollstream import Rollstream
from rollstream.consumers.control.simulate_cli import SimulateSettings, run

SMALL = WORKLOADS["this_machine"]
# long-tailed generation, partial rollouts, fewer steps: every mechanism, in a fraction of a second
AREAL_SHORT = WORKLOADS["areal"].replace(steps=4)
VERL_SHORT = WORKLOADS["verl_fully_async"].replace(steps=4)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_run_is_a_function_of_its_seed(policy: str) -> None:
    first = simulate(SMALL, policy, seed=3)
    assert simulate(SMALL, policy, seed=3).to_json() == first.to_json()
    assert simulate(SMALL, policy, seed=4).wall_s != first.wall_s


@pytest.mark.parametrize("workload", [SMALL, AREAL_SHORT])
def test_sync_trains_every_sample_fresh_and_wastes_none(workload: Workload) -> None:
    r = simulate(workload, "sync", seed=1)
    assert set(r.staleness) == {0}
    assert r.rollouts_wasted == r.rollouts_waiting == r.rollouts_in_flight == 0
    assert r.samples_trained == r.steps * workload.samples_per_step


@pytest.mark.parametrize("workload", [SMALL, AREAL_SHORT, VERL_SHORT])
@pytest.mark.parametrize("policy", ["fully_async", "rollstream", "rollstream_partial"])
def test_bounded_policies_never_train_staler_than_the_bound(
    workload: Workload, policy: str
) -> None:
    r = simulate(workload, policy, seed=2)
    assert max(r.staleness) <= workload.max_staleness
    assert sum(r.staleness.values()) == r.samples_trained > 0


def test_one_step_off_elastic_is_at_most_one_version_stale() -> None:
    r = simulate(AREAL_SHORT, "elastic", seed=0)
    assert set(r.staleness) == {0, 1} and r.rollouts_wasted == 0


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("workload", [SMALL, AREAL_SHORT])
def test_rollouts_are_conserved(workload: Workload, policy: str) -> None:
    r = simulate(workload, policy, seed=5)
    assert r.rollouts_started == (
        r.rollouts_trained + r.rollouts_wasted + r.rollouts_waiting + r.rollouts_in_flight
    )
    assert r.samples_trained == r.steps * workload.samples_per_step
    assert r.util_rollout >= 0 and r.util_train >= 0 and r.util <= 1 + 1e-9


@pytest.mark.parametrize("name", [n for n, w in WORKLOADS.items() if w.published_speedup])
def test_each_papers_policy_lands_within_15_percent_of_its_published_speedup(name: str) -> None:
    w = WORKLOADS[name]
    assert w.paper_policy is not None and w.published_speedup is not None
    sync = simulate(w, "sync", seed=0)
    paper = simulate(w, w.paper_policy, seed=0)
    speedup = sync.step_s / paper.step_s
    assert abs(speedup / w.published_speedup - 1) <= 0.15, (name, speedup)


PUBLISHED = ("sync", "collocated_async", "fully_async", "elastic")
# the rollstream policy ahead of the best published one: with the proxy's default draining
# weight updates, or with its interrupt mode (long generation tails: areal, verl)
AHEAD = {
    "agent_lightning": "rollstream",
    "qwengyre_a": "rollstream",
    "qwengyre_b": "rollstream",
    "areal": "rollstream_partial",
    "verl_fully_async": "rollstream_partial",
}


@pytest.mark.parametrize("name", [n for n, w in WORKLOADS.items() if w.published_speedup])
def test_rollstreams_policy_is_ahead_of_every_published_policy_on_each_paper_workload(
    name: str,
) -> None:
    w = WORKLOADS[name]
    best = min(simulate(w, p, seed=0).step_s for p in PUBLISHED)
    ours = simulate(w, AHEAD[name], seed=0)
    assert ours.step_s < best, (name, best, ours.step_s)
    assert max(ours.staleness) <= w.max_staleness


def test_the_split_goes_most_of_the_way_at_the_first_measured_step() -> None:
    # qwengyre_a: generation far outruns training, the first step finds the window full
    # (3 steps of samples, 2 beyond the target): the split moves two share_steps at once and
    # reaches one inference accelerator (1/N) at the third version
    w = WORKLOADS["qwengyre_a"]
    engine = Engine(w, 0, float(w.accelerators))
    driver = Rollstream(engine, w.steps)
    engine.run(driver, driver.start)
    moves = [d for d in driver.decisions if d.reason == "trainer-behind"]
    assert moves[0].inference_share == pytest.approx(w.inference_share - 2 * 0.1)
    assert moves[2].t < engine.step_ends[3]  # the third move, at the third version
    assert moves[2].inference_share == pytest.approx(1 / w.accelerators)


def test_unknown_policy_and_bad_steps_are_refused() -> None:
    with pytest.raises(WorkloadError) as caught:
        simulate(SMALL, "magic")
    assert caught.value.field == "policy"
    with pytest.raises(WorkloadError):
        simulate(SMALL, "sync", steps=0)


def test_a_workload_from_json_overrides_a_built_in_one_and_names_a_bad_field() -> None:
    w = workload_from_json({"base": "this_machine", "rollout_slots": 4, "env_median_s": 2.0})
    assert (w.rollout_slots, w.env_median_s, w.accelerators) == (4, 2.0, SMALL.accelerators)
    assert workload_from_json(json.loads(json.dumps(w.to_json()))) == w
    for bad, field in [
        ({"base": "this_machine", "accelerators": 1}, "accelerators"),
        ({"base": "this_machine", "tokens_sigma": -1}, "tokens_sigma"),
        ({"base": "this_machine", "warp": 9}, "warp"),
        ({"base": "nowhere"}, "name"),
    ]:
        with pytest.raises(WorkloadError) as caught:
            workload_from_json(bad)
        assert caught.value.field == field, bad
        assert isinstance(caught.value, ControlError)
    with pytest.raises(WorkloadError):
        workload_from_json({"base": "this_machine", "turns_min": 5, "turns_max": 2})


def test_the_cli_prints_json_and_writes_the_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "measured.json"
    spec.write_text(json.dumps({"base": "this_machine", "env_median_s": 0.2, "steps": 4}))
    plot = tmp_path / "sim.png"
    settings = SimulateSettings(
        workload=str(spec),
        policies=["fully_async", "rollstream"],
        seeds=1,
        plot=plot,
        json_output=True,
    )
    assert run(settings, Console(file=open(tmp_path / "out.txt", "w"))) == 0  # noqa: SIM115
    out = json.loads(capsys.readouterr().out)
    assert [p["policy"] for p in out["policies"]] == ["fully_async", "rollstream"]
    assert out["workload"]["env_median_s"] == 0.2 and out["steps"] == 4
    assert all(p["speedup"] > 0 for p in out["policies"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_cli_table_and_its_refusals(tmp_path: Path) -> None:
    console = Console(record=True, width=160)
    settings = SimulateSettings(workload="this_machine", policies=["sync"], seeds=1, samples=64)
    assert run(settings, console) == 0
    text = console.export_text()
    assert "this_machine: 2 steps of 32 samples" in text and "1.00x" in text
    assert run(SimulateSettings(workload=str(tmp_path / "missing.json")), console) == 2
    with pytest.raises(ValidationError):
        SimulateSettings(policies=["sync", "magic"])
    with pytest.raises(ValidationError):
        SimulateSettings(seeds=0)


MEASURED = Path(__file__).resolve().parents[2] / "bench" / "this_machine.json"


def test_the_measured_workload_of_this_machine_loads_and_runs_the_benchmarks_setting() -> None:
    w = workload_from_json(json.loads(MEASURED.read_text()))
    # bench/bench_async_rl.py's setting: 4 tasks x 8 rollouts, 2 turns, env lognormal(1 s, 1)
    assert (w.groups_per_step, w.group_size, w.samples_per_step) == (4, 8, 32)
    assert (w.turns_min, w.turns_max) == (2, 2)
    assert (w.env_median_s, w.env_sigma, w.env_max_s, w.env_tail_p) == (1.0, 1.0, 20.0, 0.0)
    assert w.rollout_overhead_s > 0 and w.rollout_slots >= w.samples_per_step
    r = simulate(w, "rollstream", seed=0)
    assert r.steps == w.steps and max(r.staleness) <= w.max_staleness


def test_step_ends_give_the_time_to_each_version() -> None:
    r = simulate(SMALL, "fully_async", seed=0, steps=5)
    assert len(r.step_ends) == 5 and r.step_ends[-1] == r.wall_s
    assert list(r.step_ends) == sorted(r.step_ends) and r.step_ends[0] > 0


def test_rollout_overhead_lengthens_each_sync_round_by_itself() -> None:
    # sync with a slot per rollout: every rollout of a round starts at once and the round
    # waits for the last, so a fixed overhead after each one's last turn adds itself per step
    roomy = SMALL.replace(rollout_slots=SMALL.samples_per_step)
    plain = simulate(roomy, "sync", seed=4, steps=3)
    slow = simulate(roomy.replace(rollout_overhead_s=1.5), "sync", seed=4, steps=3)
    assert slow.wall_s == pytest.approx(plain.wall_s + 3 * 1.5)
    assert slow.samples_trained == plain.samples_trained
