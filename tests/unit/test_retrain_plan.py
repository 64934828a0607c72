"""The pure parts of ``rollstream retrain`` (consumers/training/retrain_plan.py): the --set
allow-list and its refusals, the manifest follower under any arrival order, and the comparison
statistics."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollstream.consumers.errors import TrainerError
from rollstream.consumers.training.retrain_plan import (
    ALLOWED,
    ManifestFollower,
    RetrainError,
    compare_samples,
    comparison_rows,
    parse_sets,
    sample_stats,
    train_stats,
)
from rollstream.consumers.training.settings import TrainerSettings
from rollstream.schemas import Sample
from rollstream.streams.settings import ProcessorSettings


def sample(sid: str, adv: float, group: str = "g", rollout: str = "r", n: int = 4) -> Sample:
    ids = np.arange(n, dtype=np.uint32)
    return Sample(
        sid, rollout, group, "t", ids, np.ones(n, np.uint8), np.zeros(n, np.float32), adv, 0.0, 0
    )


# ---- --set -------------------------------------------------------------------------------------


def test_every_allowed_key_names_a_field_of_its_settings_class() -> None:
    for key, spec in ALLOWED.items():
        cls = ProcessorSettings if spec.kind == "processor" else TrainerSettings
        assert spec.field in cls.model_fields, key


def test_sets_split_into_processor_and_trainer_changes() -> None:
    plan = parse_sets(["scorer=milestones", "LR=3e-5", "proc_adv_leave_one_out=true"])
    assert plan.processor == {"proc_scorer": "milestones", "proc_adv_leave_one_out": "true"}
    assert plan.trainer == {"train_lr": "3e-5"}
    assert plan.rebuilds_samples and not plan.changes_batching and not plan.can_follow
    trainer_only = parse_sets(["lr=3e-5", "clip_high=0.3"])
    assert not trainer_only.rebuilds_samples and trainer_only.can_follow
    batching = parse_sets(["max_staleness=1"])
    assert batching.changes_batching and not batching.can_follow
    assert parse_sets([]).describe() == "no setting changed" and parse_sets([]).can_follow
    assert parse_sets(["dapo=false"]).processor == {"proc_drop_zero_variance": "false"}


@pytest.mark.parametrize(
    ("item", "reason"),
    [
        ("temperature=0.7", "new rollouts"),
        ("top_p=0.9", "new rollouts"),
        ("group_size=8", "new rollouts"),
        ("seed=3", "initial model"),
        ("poll_records=10", "not a setting a retrain changes"),
        ("lr", "KEY=VALUE"),
        ("=3", "KEY=VALUE"),
    ],
)
def test_refused_keys_say_why(item: str, reason: str) -> None:
    with pytest.raises(RetrainError, match=reason) as info:
        parse_sets([item])
    assert isinstance(info.value, TrainerError)


def test_a_key_given_twice_with_two_values_is_refused() -> None:
    with pytest.raises(RetrainError, match="twice"):
        parse_sets(["lr=1e-5", "train_lr=2e-5"])
    assert parse_sets(["lr=1e-5", "train_lr=1e-5"]).trainer == {"train_lr": "1e-5"}


# ---- the follower ------------------------------------------------------------------------------

STEPS = {1: ["a", "b"], 2: ["c", "d", "e"], 3: ["f"], 4: ["g", "h"]}


@given(st.randoms(use_true_random=False), st.integers(0, 3))
def test_the_follower_gives_each_step_its_samples_in_order_whatever_the_arrival(
    rnd: random.Random, after: int
) -> None:
    follower: ManifestFollower[str] = ManifestFollower(STEPS, after=after)
    arrivals = [x for ids in STEPS.values() for x in ids] + ["stray", "a", "c"]  # + copies
    rnd.shuffle(arrivals)
    taken: list[tuple[int, list[str]]] = []
    for item in arrivals:
        follower.add(item, f"rec-{item}")
        while (ready := follower.ready()) is not None:
            taken.append((follower.step, ready))
    assert taken == [(k, [f"rec-{x}" for x in STEPS[k]]) for k in sorted(STEPS) if k > after]
    assert follower.finished and not follower.held


def test_the_follower_holds_only_samples_of_steps_to_come() -> None:
    follower: ManifestFollower[int] = ManifestFollower(STEPS, after=1)
    assert not follower.add("a", 1)  # step 1 is behind
    assert not follower.add("zzz", 2)  # in no step
    assert follower.add("c", 3) and not follower.add("c", 4)  # a copy is not held twice
    assert follower.missing() == ["d", "e"] and follower.ready() is None
    follower.reset(1)
    assert not follower.held and follower.last_step == 4


# ---- comparison ---------------------------------------------------------------------------------


def test_sample_stats_and_comparison() -> None:
    before = [sample("s1", 1.0, "g1"), sample("s2", -1.0, "g1"), sample("s3", 0.5, "g2")]
    after = [sample("s1", -0.5, "g1"), sample("s2", -1.0, "g1"), sample("s4", 0.0, "g3")]
    stats = sample_stats(before)
    assert stats.samples == 3 and stats.groups == 2 and stats.tokens == 12
    assert stats.positive == 2 and stats.negative == 1 and stats.zero == 0
    assert math.isclose(stats.adv_mean, 0.5 / 3)
    diff = compare_samples(before, after)
    assert (diff.common, diff.only_before, diff.only_after) == (2, 1, 1)
    assert diff.sign_flips == 1 and diff.advantage_changed == 1
    assert (diff.groups_dropped, diff.groups_added) == (1, 1) and not diff.identical
    assert compare_samples(before, list(reversed(before))).identical
    rows = {r[0]: r[1:] for r in comparison_rows(diff, None, None)}
    assert rows["advantage sign flips"] == ("", "1")
    assert "loss mean" not in rows


def test_train_stats_count_from_the_starting_version() -> None:
    metrics = {
        1: {"loss": 0.5, "batch_samples": 4.0, "stale_dropped": 2.0, "duplicates_dropped": 0.0},
        2: {"loss": 0.25, "batch_samples": 4.0, "stale_dropped": 3.0, "duplicates_dropped": 1.0},
        3: {"loss": 0.125, "batch_samples": 2.0, "stale_dropped": 5.0, "duplicates_dropped": 1.0},
    }
    stats = train_stats(metrics, after=1)
    assert (stats.steps, stats.first_version, stats.last_version) == (2, 2, 3)
    assert stats.loss_first == 0.25 and stats.loss_last == 0.125
    assert stats.samples_trained == 6 and stats.stale_dropped == 3
    assert stats.duplicates_dropped == 1 and math.isclose(stats.loss_mean, 0.1875)
    empty = train_stats({}, after=2)
    assert empty.steps == 0 and math.isnan(empty.loss_mean)


def test_the_cli_refuses_a_sampling_key_with_its_reason_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from rollstream.infra.cli import main

    code = main(["retrain", "--run", "r", "--to", "b", "--namespace", "a", "--set", "top_p=0.5"])
    assert code == 2
    err = capsys.readouterr().err
    assert "top_p" in err and "new rollouts" in err
