"""``rollstream retrain``: a run retrained in another namespace with changed processor and
trainer settings, then compared with the original (the I/O shell; the pure parts, the --set
allow-list, the manifest follower and the comparison statistics, are
consumers/training/retrain_plan.py).

    RetrainSettings(ReplaySettings)     ROLLSTREAM_RETRAIN_* plus the replay's (docs/retrain.md)
    run(settings) -> RetrainResult      the stages below, with progress on stderr
    show(result)                        the comparison table (and the PNG with --plot)

Stages (``namespace`` is the source, ``replay_to`` the target; nothing is written to the source):

1. events: the run's raw events replayed into the target (``replay.run``, its filters, plus
   ``replay_run_ids = [retrain_run]``).
2. samples: with a processor setting changed (or ``retrain_rebuild``), rebuilt from the target's
   events by the batch path (``streams.batch_job.run_batch(in_place=True)``) with the changed
   processor settings; otherwise the source's samples of the replayed rollouts are copied into
   the target's samples topic (the processors are not run again).
3. training: from version V of the source's checkpoints (copied into the target's checkpoint
   root, read only at the source) or, for V = 0, from the source's initial model, with the
   source's recorded trainer settings (``CheckpointMeta.train_config``) and the changed ones.
   With no processor setting changed and no trainer setting that changes which samples a step
   takes, the trainer follows the source's step manifests (``train_follow``): step k trains the
   samples step k trained there, in that order. PolicyVersions go to the target's topic only.
4. comparison: samples and advantages (source vs target samples of the same rollouts), and
   training (the source's PolicyVersion metrics for versions > V vs the retrain's).

``retrain_dry_run``: no write at all: the source's events of the run go through the batch path
in memory with the changed processor settings, compared with the source's samples.

Errors: ``RetrainError`` (consumers/training/retrain_plan.py, a ``TrainerError``); through the
stages ``ReplayError``, ``BatchJobError``, ``CheckpointError``, ``TrainerError``.
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rollstream.adapters.codecs import build_codec
from rollstream.adapters.topics import ensure_topics, watermarks
from rollstream.consumers.analytics.replay import ReplaySettings
from rollstream.consumers.analytics.replay import run as replay
from rollstream.consumers.training.checkpoint import (
    LATEST,
    CheckpointMeta,
    read_checkpoint,
    read_manifests,
)
from rollstream.consumers.training.retrain_plan import (
    RetrainError,
    RetrainPlan,
    SampleDiff,
    TrainStats,
    compare_samples,
    comparison_rows,
    parse_sets,
    train_stats,
)
from rollstream.consumers.training.settings import TrainerSettings
from rollstream.schemas import Codec, CommonSettings, DecodeError, Event, PolicyVersion, Sample

__all__ = ["RetrainError", "RetrainResult", "RetrainSettings", "run", "show"]


class RetrainSettings(ReplaySettings):
    """``namespace`` is the source run's, ``replay_to`` the target; the replay filters apply."""

    retrain_run: str = Field("", max_length=256)  # the run id (RolloutStarted.run_id); required
    retrain_from_version: int = Field(0, ge=0, le=10_000_000)  # start from this version (0: init)
    retrain_sets: list[str] = Field(default_factory=list, max_length=64)  # KEY=VALUE changes
    retrain_source_checkpoints: Path | None = None  # default <home>/<ns>/checkpoints if present
    retrain_dry_run: bool = False  # compare rebuilt samples only: nothing written, no training
    retrain_rebuild: bool = False  # rebuild samples even when no processor setting changed
    retrain_max_steps: int | None = Field(None, ge=1, le=10_000_000)  # default: source's last
    retrain_idle_s: float = Field(2.0, gt=0.0, le=600.0)  # trainer: flush / exit when idle
    retrain_plot: Path | None = None  # write the comparison as a PNG here
    retrain_timeout_s: float = Field(60.0, gt=0.0, le=3600.0)  # topic reads, metadata
    # processes for the batch path (rebuild and dry run); > 1 holds the run's events in memory
    retrain_workers: int = Field(1, ge=1, le=64)


@dataclass
class RetrainResult:
    source: str
    target: str
    plan: str
    dry_run: bool
    samples_path: str  # how the target's samples were made
    follow: bool  # the trainer followed the source's step manifests
    from_version: int
    events_replayed: int = 0
    samples_built: int = 0
    steps_trained: int = 0
    diff: SampleDiff | None = None
    original: TrainStats | None = None
    retrained: TrainStats | None = None
    rows: list[tuple[str, str, str]] = field(default_factory=list)
    checkpoints: Path | None = None
    plot: Path | None = None
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # per stage: events, samples, ...


# ---- settings ----------------------------------------------------------------------------------


def _common(settings: CommonSettings) -> dict[str, Any]:
    return {name: getattr(settings, name) for name in CommonSettings.model_fields}


def _changed(base: BaseSettings, changes: dict[str, Any]) -> Any:
    """``base`` with ``changes``, validated by its class (bounds apply; env not read again)."""
    try:
        return type(base).model_validate({**base.model_dump(), **changes})
    except ValidationError as exc:
        raise RetrainError(f"--set: {exc}") from exc


def _source_root(s: RetrainSettings) -> Path:
    if s.retrain_source_checkpoints is not None:
        return s.retrain_source_checkpoints
    for root in (s.home / s.namespace / "checkpoints", s.home / "checkpoints"):
        if (root / LATEST).is_file():
            return root
    raise RetrainError(
        f"no checkpoints of {s.namespace!r} under {s.home} (set --checkpoints to the run's "
        "checkpoint root)"
    )


def _source_meta(root: Path, version: int) -> tuple[CheckpointMeta, CheckpointMeta | None]:
    """The source's latest checkpoint meta, and version ``version``'s (None for 0)."""
    latest = read_checkpoint(root / (root / LATEST).read_text().strip())
    if version == 0:
        return latest.meta, None
    path = root / f"step-{version:08d}"
    if not (path / "meta.json").is_file():
        kept = sorted(int(p.name[5:]) for p in root.glob("step-*") if (p / "meta.json").is_file())
        raise RetrainError(
            f"version {version} of the source run is not on disk in {root} (kept: {kept} and "
            f"0, the initial model; raise ROLLSTREAM_CHECKPOINT_KEEP to keep more)"
        )
    return latest.meta, read_checkpoint(path).meta


# ---- topics ------------------------------------------------------------------------------------


def _read(settings: CommonSettings, topic: str, timeout_s: float) -> list[Any]:
    """Every message of ``topic`` up to the high watermarks seen now (read only: no group)."""
    consumer = Consumer(
        {
            **settings.kafka_config(),
            "group.id": f"rollstream-retrain-read-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    try:
        md = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
        if md is None or md.error is not None:
            return []
        ranges = {
            p: watermarks(consumer, TopicPartition(topic, p), timeout_s) for p in md.partitions
        }
        ends = {p: hi for p, (lo, hi) in ranges.items() if hi > lo}
        consumer.assign([TopicPartition(topic, p, ranges[p][0]) for p in ends])
        out: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while ends:
            if time.monotonic() > deadline:
                raise RetrainError(f"could not read {topic} to its end in {timeout_s:.0f}s")
            for msg in consumer.consume(1000, 0.2):
                p, offset = msg.partition(), msg.offset()
                if msg.error() is not None or p is None or offset is None or p not in ends:
                    continue
                if offset < ends[p]:
                    out.append(msg)
                if offset >= ends[p] - 1:
                    del ends[p]
        return out
    finally:
        consumer.close()


def _samples(msgs: list[Any], codec: Codec, rollouts: set[str] | None) -> list[Sample]:
    out = []
    for m in msgs:
        try:
            sample = codec.decode(m.value(), expect=Sample)
        except DecodeError:
            continue
        if rollouts is None or sample.rollout_id in rollouts:
            out.append(sample)
    return out


def _policy_metrics(
    settings: CommonSettings, codec: Codec, timeout_s: float
) -> dict[int, dict[str, float]]:
    found: dict[int, dict[str, float]] = {}
    for m in _read(settings, settings.topics().policy, timeout_s):
        try:
            record = codec.decode(m.value(), expect=PolicyVersion)
        except DecodeError:
            continue
        found[record.version] = dict(record.metrics)
    return found


def _selected_records(s: RetrainSettings, codec: Codec) -> tuple[list[Any], set[str]]:
    """The source's event records of the selected rollouts (decided on each rollout's first
    record, as the replay does), in each partition's order, and their rollout ids."""
    flt = s.rollout_filter()
    decided: dict[bytes, bool] = {}
    kept = []
    for m in _read(s, s.topics().events, s.retrain_timeout_s):
        key = m.key()
        verdict = decided.get(key) if key else None
        if verdict is None:
            try:
                event = codec.decode(m.value(), expect=Event)
            except DecodeError:
                continue
            key = event.rollout_id.encode()
            verdict = decided.setdefault(key, flt.matches(event))
        if verdict:
            kept.append(m)
    return kept, {k.decode() for k, v in decided.items() if v}


def _copy_samples(
    source: CommonSettings, target: CommonSettings, codec: Codec, rollouts: set[str], t: float
) -> int:
    """The source's samples of ``rollouts`` into the target's samples topic (same key, same
    bytes, Kafka's default partitioner as the processors), in each partition's order."""
    producer = Producer(
        {**target.kafka_config(), "enable.idempotence": True, "acks": "all",
         "partitioner": "murmur2_random", "linger.ms": 20}
    )  # fmt: skip
    n = 0
    for m in _read(source, source.topics().samples, t):
        try:
            sample = codec.decode(m.value(), expect=Sample)
        except DecodeError:
            continue
        if sample.rollout_id in rollouts:
            producer.produce(target.topics().samples, m.value(), m.key())
            producer.poll(0)
            n += 1
    if producer.flush(t):
        raise RetrainError(f"samples not delivered to {target.topics().samples}")
    return n


# ---- run ---------------------------------------------------------------------------------------


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )


def run(settings: RetrainSettings, console: Console | None = None) -> RetrainResult:
    """Retrain ``settings.retrain_run`` of ``settings.namespace`` into ``settings.replay_to``."""
    started = time.monotonic()
    console = console or Console(stderr=True)
    s = settings
    if not s.retrain_run:
        raise RetrainError("name the run to retrain (--run RUN: its RolloutStarted.run_id)")
    target_ns = s.replay_to.strip(".")
    if not target_ns or target_ns == s.namespace.strip("."):
        raise RetrainError("the target namespace (--to) must be set and differ from the source")
    plan = parse_sets(s.retrain_sets)
    s = s.model_copy(
        update={
            "replay_run_ids": sorted({*s.replay_run_ids, s.retrain_run}),
            "replay_to": target_ns,
        }
    )
    from rollstream.streams.settings import ProcessorSettings

    proc = _changed(ProcessorSettings(**{**_common(s), "namespace": target_ns}), plan.processor)
    codec = build_codec(s)
    if s.retrain_dry_run:
        return _dry_run(s, plan, proc, codec, console, started)

    root = _source_root(s)
    v = s.retrain_from_version
    latest, at_v = _source_meta(root, v)
    target_root = s.home / target_ns / "checkpoints"
    if (target_root / LATEST).exists():
        raise RetrainError(f"{target_root} holds checkpoints already: retrain into a new --to")
    manifests = {k: m for k, m in read_manifests(root) if k <= latest.step}
    steps = range(v + 1, latest.step + 1)
    follow = plan.can_follow and all(k in manifests and manifests[k].trained_ids for k in steps)
    result = RetrainResult(
        s.namespace, target_ns, plan.describe(), False, "", follow and latest.step > v, v
    )

    # 1. events
    console.print(f"[bold]retrain[/] {s.namespace} run {s.retrain_run} -> {target_ns}: "
                  f"{plan.describe()}")  # fmt: skip
    mark = time.monotonic()
    replayed = replay(s)
    result.events_replayed = replayed.published
    target = CommonSettings(**{**_common(s), "namespace": target_ns})
    rollouts = {m.key().decode() for m in _read(target, target.topics().events, s.retrain_timeout_s)
                if m.key()}  # fmt: skip
    console.print(f"events replayed: {replayed.published:,} ({len(rollouts)} rollouts)")
    result.seconds["events"], mark = time.monotonic() - mark, time.monotonic()

    # 2. samples
    if plan.rebuilds_samples or s.retrain_rebuild:
        from rollstream.streams.batch_job import run_batch

        built = run_batch(
            target, proc, in_place=True, timeout_s=s.retrain_timeout_s, workers=s.retrain_workers
        )
        result.samples_built = int(built["written"].get("samples", 0))
        result.samples_path = "batch path (streams/batch_job.py) over the replayed events"
    else:
        ensure_topics(target)
        result.samples_built = _copy_samples(s, target, codec, rollouts, s.retrain_timeout_s)
        result.samples_path = (
            f"copied from {s.topics().samples} (no processor setting changed: processors not "
            "run again)"
        )
    console.print(f"samples built: {result.samples_built:,} ({result.samples_path})")
    result.seconds["samples"], mark = time.monotonic() - mark, time.monotonic()
    before = _samples(_read(s, s.topics().samples, s.retrain_timeout_s), codec, rollouts)
    after = _samples(_read(target, target.topics().samples, s.retrain_timeout_s), codec, None)
    result.diff = compare_samples(before, after)
    result.seconds["compare_samples"], mark = time.monotonic() - mark, time.monotonic()

    # 3. training
    trainer = _trainer_settings(s, plan, target_ns, target_root, root, latest, at_v, follow)
    if at_v is not None:
        target_root.mkdir(parents=True, exist_ok=True)
        name = f"step-{v:08d}"
        shutil.copytree(root / name, target_root / name)
        (target_root / LATEST).write_text(name + "\n")
    result.follow = trainer.train_follow is not None
    if result.follow:
        console.print(f"training by manifest: steps {v + 1}..{latest.step} of {root}")
    else:
        result.notes.append(
            "trained in arrival order (a processor or batching setting changed, or the source's "
            "manifests carry no sample ids)"
        )
    total = (trainer.train_max_steps or latest.step) - v
    from rollstream.consumers.training.trainer import run as train

    with _progress(console) as progress:
        task = progress.add_task("steps trained", total=max(total, 0))
        on_step: Callable[[CheckpointMeta], None] = lambda meta: progress.update(  # noqa: E731
            task, completed=meta.step - v
        )
        trained = train(trainer, on_step=on_step)
    result.steps_trained = trained.steps_run
    result.seconds["training"], mark = time.monotonic() - mark, time.monotonic()
    result.checkpoints = target_root

    # 4. comparison
    original = _policy_metrics(s, codec, s.retrain_timeout_s)
    retrained = _policy_metrics(target, codec, s.retrain_timeout_s)
    if at_v is not None:  # the counters at V (cumulative) are the baseline of both
        retrained.setdefault(v, {**at_v.metrics, **at_v.counters})
        original.setdefault(v, {**at_v.metrics, **at_v.counters})
    result.original = train_stats({k: x for k, x in original.items() if k <= latest.step}, v)
    result.retrained = train_stats(retrained, v)
    result.rows = comparison_rows(result.diff, result.original, result.retrained)
    if s.retrain_plot is not None:
        result.plot = _plot(s.retrain_plot, result, before, after)
    result.wall_s = time.monotonic() - started
    return result


def _trainer_settings(
    s: RetrainSettings,
    plan: RetrainPlan,
    target_ns: str,
    target_root: Path,
    source_root: Path,
    latest: CheckpointMeta,
    at_v: CheckpointMeta | None,
    follow: bool,
) -> TrainerSettings:
    """The source's trainer settings (as its checkpoint recorded them), the changes, and the
    target's names and stopping rules."""
    base = TrainerSettings(**_common(s))
    recorded = (at_v or latest).train_config
    if recorded and "train_objective" not in recorded:  # recorded before it was a setting: PPO
        recorded = {**recorded, "train_objective": "ppo"}
    base = _changed(base, {k: x for k, x in recorded.items() if k in TrainerSettings.model_fields})
    base = _changed(base, plan.trainer)
    model = Path(latest.base_model) if latest.base_model else base.resolved_model_path()
    return base.model_copy(
        update={
            "namespace": target_ns,
            "checkpoint_dir": target_root,
            "model_path": model,
            "model_create": not model.exists(),
            "train_follow": source_root if follow else None,
            "train_max_steps": s.retrain_max_steps or latest.step,
            "train_flush_idle_s": s.retrain_idle_s,
            "train_exit_idle_s": s.retrain_idle_s + 0.5,
            "train_start": "earliest",
        }
    )


def _dry_run(
    s: RetrainSettings,
    plan: RetrainPlan,
    proc: Any,
    codec: Codec,
    console: Console,
    started: float,
) -> RetrainResult:
    """The run's events through the batch path in memory, against the source's samples."""
    from rollstream.streams.app import group_route
    from rollstream.streams.batch import BatchConfig, SourceRecord
    from rollstream.streams.batch_parallel import process_batch_parallel

    result = RetrainResult(
        s.namespace, s.replay_to, plan.describe(), True, "batch path, in memory (dry run)",
        False, s.retrain_from_version,
    )  # fmt: skip
    records, rollouts = _selected_records(s, codec)
    result.events_replayed = len(records)
    meta = Consumer({**s.kafka_config(), "group.id": f"rollstream-retrain-{uuid.uuid4().hex[:8]}"})
    try:
        topic = s.topics().trajectories
        found = meta.list_topics(topic, timeout=s.retrain_timeout_s).topics.get(topic)
        n = len(found.partitions) if found is not None and found.partitions else 1
    finally:
        meta.close()
    config = BatchConfig.from_settings(
        proc,
        route=group_route(n),
        events_topic=s.topics().events,
        real_now=lambda: time.time_ns() // 1000,
    )
    out = process_batch_parallel(
        (SourceRecord(m.partition(), m.offset(), m.key(), m.value()) for m in records),
        config,
        codec,
        workers=s.retrain_workers,
    )
    after = [codec.decode(o.value, expect=Sample) for o in out.samples]
    result.samples_built = len(after)
    before = _samples(_read(s, s.topics().samples, s.retrain_timeout_s), codec, rollouts)
    result.diff = compare_samples(before, after)
    result.rows = comparison_rows(result.diff, None, None)
    console.print(
        f"dry run: {len(records):,} events of {len(rollouts)} rollouts -> {len(after):,} samples"
    )
    if s.retrain_plot is not None:
        result.plot = _plot(s.retrain_plot, result, before, after)
    result.wall_s = time.monotonic() - started
    return result


# ---- output ------------------------------------------------------------------------------------


def show(result: RetrainResult, console: Console | None = None) -> None:
    """The comparison table, and a line on how the retrain ran."""
    console = console or Console()
    table = Table(title=f"{result.source} (original) vs {result.target} (retrained): {result.plan}")
    table.add_column("")
    table.add_column("original", justify="right")
    table.add_column("retrained", justify="right")
    for row in result.rows:
        table.add_row(*row)
    console.print(table)
    how = "dry run: nothing written" if result.dry_run else (
        f"from version {result.from_version}, "
        f"{'by the source manifests' if result.follow else 'in arrival order'}, "
        f"{result.steps_trained} steps; checkpoints {result.checkpoints}"
    )  # fmt: skip
    console.print(f"samples: {result.samples_path}; {how}; {result.wall_s:.1f}s")
    for note in result.notes:
        console.print(f"note: {note}")
    if result.plot is not None:
        console.print(f"plot: {result.plot}")


def _plot(path: Path, result: RetrainResult, before: list[Sample], after: list[Sample]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for label, stats in (("original", result.original), ("retrained", result.retrained)):
        if stats is not None and stats.losses:
            xs, ys = zip(*stats.losses, strict=True)
            left.plot(xs, ys, marker="o", label=label)
    left.set(title="loss per policy version", xlabel="version", ylabel="loss")
    if left.lines:
        left.legend()
    right.hist([x.advantage for x in before], bins=30, alpha=0.6, label="original")
    right.hist([x.advantage for x in after], bins=30, alpha=0.6, label="retrained")
    right.set(title="sample advantages", xlabel="advantage", ylabel="samples")
    right.legend()
    fig.suptitle(f"{result.source} -> {result.target}: {result.plan}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
