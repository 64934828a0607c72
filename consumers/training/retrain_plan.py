"""The pure parts of ``rollstream retrain`` (infra/retrain.py is the I/O shell): which settings
a retrain may change, how a trainer follows another run's step manifests, and the statistics
that compare the original run with the retrained one.

    parse_sets(["scorer=milestones", "lr=3e-5"]) -> RetrainPlan    the --set allow-list
    ManifestFollower(steps, after=V)                                step k's samples, in order
    sample_stats(samples) / compare_samples(before, after)          advantage stats, sign flips
    train_stats(metrics_by_version)                                 loss, kept / dropped
    comparison_rows(...)                                            the comparison table

What may change: the processors' settings that rebuild samples from the same events (scorer,
advantage options, DAPO filter, sample mode, ...) and the trainer's (staleness bound, loss
options, learning rate, batch token budget, ...). What may not: whatever decided how the
recorded tokens were sampled (temperature, top_p, the model, the group size): the events hold
those tokens, so another value would need new rollouts. Values are strings here; the shell
validates them against the settings classes (their bounds apply).

Pure: imports no I/O library and no torch (import-linter contract "pure").

Errors: ``RetrainError`` (a ``TrainerError``, rollstream.consumers.errors): a refused or
malformed ``--set``, a retrain that cannot run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

from rollstream.consumers.errors import TrainerError
from rollstream.schemas import Sample

__all__ = [
    "ALLOWED",
    "REFUSED",
    "ManifestFollower",
    "RetrainError",
    "RetrainPlan",
    "SampleDiff",
    "SampleStats",
    "SettingKey",
    "TrainStats",
    "compare_samples",
    "comparison_rows",
    "parse_sets",
    "sample_stats",
    "train_stats",
]

T = TypeVar("T")
Kind = Literal["processor", "trainer"]


class RetrainError(TrainerError):
    """A refused or malformed ``--set``, or a retrain that cannot run (a missing checkpoint)."""


@dataclass(frozen=True, slots=True)
class SettingKey:
    """One key ``--set`` accepts: the settings field it changes, and whether a change alters
    which samples a step trains (``batching``: then a retrain cannot follow the source's
    manifests)."""

    kind: Kind
    field: str
    what: str
    batching: bool = False


_KEYS = (
    SettingKey("processor", "proc_scorer", "the scorer of partial progress (a registered name)"),
    SettingKey("processor", "proc_adv_normalize_std", "advantage: divide by the group's std"),
    SettingKey("processor", "proc_adv_leave_one_out", "advantage: leave-one-out baseline"),
    SettingKey("processor", "proc_adv_eps", "advantage: epsilon added to the std"),
    SettingKey("processor", "proc_adv_std_ddof", "advantage: std degrees of freedom"),
    SettingKey("processor", "proc_drop_zero_variance", "DAPO: drop groups with one reward"),
    SettingKey("processor", "proc_sample_mode", "path or tree samples"),
    SettingKey("processor", "proc_share_prefixes", "tree mode: shared prefixes trained once"),
    SettingKey("processor", "proc_dedup_calls", "deduplicate identical branches"),
    SettingKey("processor", "proc_inactivity_timeout_s", "close a silent rollout after (s)"),
    SettingKey("processor", "proc_group_timeout_s", "close an unfilled group after (s)"),
    SettingKey("trainer", "train_max_staleness", "staleness bound (versions)", batching=True),
    SettingKey("trainer", "train_token_budget", "padded tokens per step", batching=True),
    SettingKey("trainer", "train_batch_samples", "cap on samples per step", batching=True),
    SettingKey("trainer", "train_lr", "AdamW learning rate"),
    SettingKey("trainer", "train_weight_decay", "AdamW weight decay"),
    SettingKey("trainer", "train_max_grad_norm", "gradient clipping (none: off)"),
    SettingKey("trainer", "train_clip_low", "PPO clip, low side"),
    SettingKey("trainer", "train_clip_high", "PPO clip, high side (clip-higher)"),
    SettingKey("trainer", "train_dual_clip", "dual clip for A < 0 (none: off)"),
    SettingKey("trainer", "train_normalization", "loss normalization: rollout, token, sequence"),
    SettingKey("trainer", "train_objective", "loss objective: decoupled or ppo"),
    SettingKey(
        "trainer",
        "train_behaviour_cap",
        "decoupled: behaviour weight cap",
    ),
)
# short names (scorer, lr, max_staleness) and the field names (proc_scorer, train_lr)
ALLOWED: dict[str, SettingKey] = {
    **{k.field.removeprefix("proc_").removeprefix("train_"): k for k in _KEYS},
    **{k.field: k for k in _KEYS},
}
ALLOWED["dapo"] = ALLOWED["drop_zero_variance"]

_SAMPLING = "a sampling setting: the recorded tokens were sampled with the old value, so another "
_NEW_ROLLOUTS = "value needs new rollouts (rollstream run-job / demo), not a retrain"
REFUSED: dict[str, str] = {
    **{
        k: _SAMPLING + _NEW_ROLLOUTS
        for k in ("temperature", "top_p", "top_k", "max_tokens", "seed_sampling", "model", "n")
    },
    "group_size": "the group's rollouts were sampled as that many attempts of a task; another "
    + _NEW_ROLLOUTS,
    "proc_group_size": "the group's rollouts were sampled as that many attempts of a task; "
    "another " + _NEW_ROLLOUTS,
    "seed": "the seed made the initial model and the run's RNG states; a retrain starts from "
    "the source's checkpoint (or its initial model) and keeps them",
    "train_seed": "the seed made the initial model and the run's RNG states; a retrain starts "
    "from the source's checkpoint (or its initial model) and keeps them",
    "device": "a device is not a training setting: pass --device (and see docs/retrain.md on "
    "GPUs and bit-equality)",
}


@dataclass(frozen=True, slots=True)
class RetrainPlan:
    """The changes a retrain makes: settings field -> value (a string, validated later)."""

    processor: dict[str, str] = field(default_factory=dict)
    trainer: dict[str, str] = field(default_factory=dict)

    @property
    def rebuilds_samples(self) -> bool:
        """The processors must run again (a processor setting changed)."""
        return bool(self.processor)

    @property
    def changes_batching(self) -> bool:
        """A trainer change that alters which samples a step trains."""
        return any(ALLOWED[f].batching for f in self.trainer)

    @property
    def can_follow(self) -> bool:
        """Steps may train the source's steps' samples (same samples, same batches)."""
        return not self.processor and not self.changes_batching

    def describe(self) -> str:
        changes = {**self.processor, **self.trainer}
        return ", ".join(f"{k}={v}" for k, v in changes.items()) or "no setting changed"


def parse_sets(items: Iterable[str]) -> RetrainPlan:
    """``KEY=VALUE`` items into a plan; a refused key raises ``RetrainError`` with the reason."""
    processor: dict[str, str] = {}
    trainer: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip().lower().replace("-", "_"), value.strip()
        if not sep or not key or not value:
            raise RetrainError(f"--set {item!r}: expected KEY=VALUE")
        if key in REFUSED:
            raise RetrainError(f"--set {key}: refused: {REFUSED[key]}")
        spec = ALLOWED.get(key)
        if spec is None:
            short = sorted(k for k in ALLOWED if not k.startswith(("proc_", "train_")))
            raise RetrainError(
                f"--set {key}: refused: not a setting a retrain changes (it is not one of "
                f"the processors' or the trainer's that act on recorded events); allowed: "
                f"{', '.join(short)}"
            )
        target = processor if spec.kind == "processor" else trainer
        if spec.field in target and target[spec.field] != value:
            raise RetrainError(f"--set {key}: given twice ({target[spec.field]!r}, {value!r})")
        target[spec.field] = value
    return RetrainPlan(processor, trainer)


# ---- following another run's manifests ---------------------------------------------------------


class ManifestFollower(Generic[T]):
    """Step k trains exactly the samples step k of the followed run trained, in its order.

    ``steps``: step -> the sample ids it trained, in order. Items come in any order; ``add``
    holds those a step after ``after`` (the step the trainer starts from) names, and ``ready``
    returns the next step's items, in the manifest's order, once all of them are held."""

    def __init__(self, steps: Mapping[int, Sequence[str]], after: int) -> None:
        self.steps = {k: list(v) for k, v in steps.items() if k > after}
        self.step = after  # the last step taken
        self.wanted: dict[str, int] = {}  # sample id -> the step that trains it
        for k in sorted(self.steps):
            for sample_id in self.steps[k]:
                self.wanted.setdefault(sample_id, k)
        self.held: dict[str, T] = {}

    @property
    def last_step(self) -> int:
        return max(self.steps, default=self.step)

    @property
    def finished(self) -> bool:
        return self.step >= self.last_step

    def add(self, sample_id: str, item: T) -> bool:
        """Hold ``item`` when a step to come trains ``sample_id`` (and it is not held yet)."""
        step = self.wanted.get(sample_id)
        if step is None or step <= self.step or sample_id in self.held:
            return False
        self.held[sample_id] = item
        return True

    def ready(self) -> list[T] | None:
        """The next step's items in order, once all are held (they leave the hold); or None.
        A planned step with no sample ids (a manifest without them) never becomes ready."""
        ids = self.steps.get(self.step + 1)
        if not ids or any(i not in self.held for i in ids):
            return None
        self.step += 1
        return [self.held.pop(i) for i in ids]

    def missing(self) -> list[str]:
        """Sample ids the next step waits for."""
        return [i for i in self.steps.get(self.step + 1, []) if i not in self.held]

    def reset(self, step: int) -> None:
        """Forget what is held (it will be read again) and continue after ``step``."""
        self.step = step
        self.held.clear()


# ---- comparison ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SampleStats:
    samples: int = 0
    rollouts: int = 0
    groups: int = 0
    tokens: int = 0
    adv_mean: float = 0.0
    adv_std: float = 0.0
    adv_min: float = 0.0
    adv_max: float = 0.0
    positive: int = 0
    negative: int = 0
    zero: int = 0


def sample_stats(samples: Sequence[Sample], eps: float = 1e-9) -> SampleStats:
    """Counts and advantage statistics (population std) of ``samples``."""
    if not samples:
        return SampleStats()
    advs = [float(s.advantage) for s in samples]
    mean = math.fsum(advs) / len(advs)
    var = math.fsum((a - mean) ** 2 for a in advs) / len(advs)
    return SampleStats(
        samples=len(samples),
        rollouts=len({s.rollout_id for s in samples}),
        groups=len({s.group_id for s in samples}),
        tokens=sum(len(s.input_ids) for s in samples),
        adv_mean=mean,
        adv_std=math.sqrt(var),
        adv_min=min(advs),
        adv_max=max(advs),
        positive=sum(a > eps for a in advs),
        negative=sum(a < -eps for a in advs),
        zero=sum(abs(a) <= eps for a in advs),
    )


def _sign(x: float, eps: float) -> int:
    return 0 if abs(x) <= eps else (1 if x > 0 else -1)


@dataclass(frozen=True, slots=True)
class SampleDiff:
    """``after`` against ``before``, by sample_id and group_id."""

    before: SampleStats
    after: SampleStats
    common: int = 0
    only_before: int = 0  # samples gone (a group dropped, another sample mode, ...)
    only_after: int = 0  # samples new
    sign_flips: int = 0  # common samples whose advantage changed sign (through zero counts)
    advantage_changed: int = 0  # common samples whose advantage moved by more than eps
    groups_dropped: int = 0  # groups with samples before, none after (e.g. DAPO)
    groups_added: int = 0  # groups with none before, samples after
    identical: bool = False  # the same samples, field by field

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {k: getattr(self, k) for k in self.__slots__}
        out["before"] = {k: getattr(self.before, k) for k in SampleStats.__slots__}
        out["after"] = {k: getattr(self.after, k) for k in SampleStats.__slots__}
        return out


def compare_samples(
    before: Sequence[Sample], after: Sequence[Sample], eps: float = 1e-6
) -> SampleDiff:
    """How ``after`` (rebuilt with new settings) differs from ``before`` (the source run's)."""
    old = {s.sample_id: s for s in before}
    new = {s.sample_id: s for s in after}
    common = old.keys() & new.keys()
    flips = sum(_sign(old[i].advantage, eps) != _sign(new[i].advantage, eps) for i in common)
    moved = sum(abs(old[i].advantage - new[i].advantage) > eps for i in common)
    groups_old = {s.group_id for s in before}
    groups_new = {s.group_id for s in after}
    identical = old.keys() == new.keys() and all(old[i] == new[i] for i in common)
    return SampleDiff(
        before=sample_stats(list(old.values())),
        after=sample_stats(list(new.values())),
        common=len(common),
        only_before=len(old.keys() - new.keys()),
        only_after=len(new.keys() - old.keys()),
        sign_flips=flips,
        advantage_changed=moved,
        groups_dropped=len(groups_old - groups_new),
        groups_added=len(groups_new - groups_old),
        identical=identical,
    )


@dataclass(frozen=True, slots=True)
class TrainStats:
    """A run's steps, from its PolicyVersion metrics (version -> metrics)."""

    steps: int = 0
    first_version: int = 0
    last_version: int = 0
    loss_first: float = math.nan
    loss_last: float = math.nan
    loss_mean: float = math.nan
    samples_trained: int = 0
    stale_dropped: int = 0
    dlq: int = 0
    duplicates_dropped: int = 0
    losses: tuple[tuple[int, float], ...] = ()


def train_stats(metrics: Mapping[int, Mapping[str, float]], after: int = 0) -> TrainStats:
    """The steps of versions > ``after`` (the retrain's starting version); counters are the
    difference between the last version and ``after`` (cumulative in the metrics)."""
    versions = sorted(v for v in metrics if v > after)
    if not versions:
        return TrainStats(first_version=after, last_version=after)
    losses = tuple((v, float(metrics[v].get("loss", math.nan))) for v in versions)
    last = metrics[versions[-1]]
    base = metrics.get(after, {})

    def delta(name: str) -> int:
        return int(last.get(name, 0.0) - base.get(name, 0.0))

    finite = [x for _, x in losses if math.isfinite(x)]
    return TrainStats(
        steps=len(versions),
        first_version=versions[0],
        last_version=versions[-1],
        loss_first=losses[0][1],
        loss_last=losses[-1][1],
        loss_mean=math.fsum(finite) / len(finite) if finite else math.nan,
        samples_trained=int(sum(metrics[v].get("batch_samples", 0.0) for v in versions)),
        stale_dropped=delta("stale_dropped"),
        dlq=delta("dlq"),
        duplicates_dropped=delta("duplicates_dropped"),
        losses=losses,
    )


def _num(x: float | int) -> str:
    if isinstance(x, int):
        return f"{x:,}"
    return "-" if not math.isfinite(x) else f"{x:.4g}"


def comparison_rows(
    samples: SampleDiff, original: TrainStats | None, retrained: TrainStats | None
) -> list[tuple[str, str, str]]:
    """(what, original, retrained) rows: samples and advantages, then training."""
    b, a = samples.before, samples.after
    rows = [
        ("samples", _num(b.samples), _num(a.samples)),
        ("groups", _num(b.groups), _num(a.groups)),
        ("rollouts", _num(b.rollouts), _num(a.rollouts)),
        ("tokens", _num(b.tokens), _num(a.tokens)),
        ("advantage mean", _num(b.adv_mean), _num(a.adv_mean)),
        ("advantage std", _num(b.adv_std), _num(a.adv_std)),
        ("advantage min / max", f"{_num(b.adv_min)} / {_num(b.adv_max)}",
         f"{_num(a.adv_min)} / {_num(a.adv_max)}"),
        ("advantage > 0 / < 0 / = 0", f"{b.positive} / {b.negative} / {b.zero}",
         f"{a.positive} / {a.negative} / {a.zero}"),
        ("samples gone / new", "", f"{samples.only_before} / {samples.only_after}"),
        ("advantage sign flips", "", _num(samples.sign_flips)),
        ("groups dropped / added", "", f"{samples.groups_dropped} / {samples.groups_added}"),
    ]  # fmt: skip
    if original is not None or retrained is not None:
        o, r = original or TrainStats(), retrained or TrainStats()
        rows += [
            ("steps (versions)", f"{o.steps} ({o.first_version}..{o.last_version})",
             f"{r.steps} ({r.first_version}..{r.last_version})"),
            ("loss first / last", f"{_num(o.loss_first)} / {_num(o.loss_last)}",
             f"{_num(r.loss_first)} / {_num(r.loss_last)}"),
            ("loss mean", _num(o.loss_mean), _num(r.loss_mean)),
            ("samples trained", _num(o.samples_trained), _num(r.samples_trained)),
            ("dropped: stale", _num(o.stale_dropped), _num(r.stale_dropped)),
            ("dropped: duplicate", _num(o.duplicates_dropped), _num(r.duplicates_dropped)),
            ("dropped: dead-lettered", _num(o.dlq), _num(r.dlq)),
        ]  # fmt: skip
    return rows
