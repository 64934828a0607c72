"""`rollstream train`: the PPO trainer over the samples topic, exactly once per sample.

The loop, top to bottom (``Trainer.run``):

    record = source.decode(msg)               # bad records -> DLQ (dataset.SampleSource)
    sample_id trained before? -> duplicate    # TrainedIds window, or earlier in the open batch
    batcher.add(sample) closes a batch?       # token budget, arrival order (batching)
    fresh = staleness filter at version N     # N = the trainer's step = version of the weights
    logp = batch_token_logprobs(model, batch) # tree forward when the batch has trees (treepack)
    loss = batch_loss(logp, batch) ; AdamW    # PPO-clip with clip-higher (ppo)
    checkpoint step N+1 (atomic, with offsets and manifest) THEN publish PolicyVersion(N+1)

Exactly once. A batch covers every record read before the sample that closed it (DLQ'd and
stale ones included), so "everything before offset X of partition p is trained or dropped" holds
at each step. The checkpoint (checkpoint.CheckpointStore) records, per partition, the next offset
after the covered records, and a manifest of them; it is committed atomically, and only then is
the PolicyVersion published (acks=all, flushed). On start the trainer loads the latest
checkpoint and, at every partition assignment, seeks to its offsets: the checkpoint is the
source of truth, never the group's committed offsets (which are committed after each checkpoint
for lag monitoring only). A crash at any point re-reads exactly the records after the last
committed step, so no sample is trained twice or skipped. If the crash came between the commit
and the publish, the start publishes the missing PolicyVersion (it reads the policy topic's
last record). Version N = weights after step N; a sample is stale when
N - sample.policy_version > max_staleness at the step that would train it.

Drop-only commits. A batch with no sample to train (all stale, duplicates or dead letters: only
the idle flush closes one, since such records take no room in the batcher) makes no step: the
weights did not change, so there is no new policy version to publish, and a step number is a
version (the ledger, the retrain follower and the loggers count on it). Its records are
committed over the latest step instead (``CheckpointStore.commit_drops``): the same step and
version, its ``meta.json`` replaced atomically with offsets past them, the counters
(``stale_dropped``, ...) grown, its manifest extended (``stale``, ``duplicate``, ``dlq``) and
``drop_commits`` + 1; the ledger gets records of that step listing them
(``train-steps/step-N-drop-k.jsonl``); the group's offsets are committed; nothing is published
and the weights, optimizer, RNG states and duplicate window are untouched (a retrain is still
bit for bit). The idle flush, an exit on ``train_exit_idle_s`` and a stop make one when
nothing trainable is pending, so every record ends trained or dropped in a committed
checkpoint. Before the first step there is nothing to commit over: dead letters read then wait
for step 1.

Once per sample_id, too: a processor restarted after a crash re-sends samples (same ids, new
offsets). The ids of the last ``train_dedup_window`` trained samples (``batching.TrainedIds``)
are committed with each checkpoint (``trained_ids.npy``); a sample found there or earlier in the
open batch is dropped before the batcher, counted (``duplicates_dropped``, ``duplicates_step``)
and listed in the manifest (``duplicate``). Stale-dropped samples do not enter the window.

Following another run (``train_follow``: a checkpoint root, read only; what ``rollstream
retrain`` sets). Step k trains exactly the samples that run's step k trained, by sample_id, in
the order of its manifest, whatever order they arrive in: records are held until the next
step's samples are all there (``retrain_plan.ManifestFollower``); the batcher, its token budget
and the staleness filter are not used (the followed run applied them). Samples no step to come
names are covered as ``skipped``; duplicates and dead letters as usual. The checkpoint offsets
stop before the first record still held, so a restart reads held records again (trained ones
are then duplicates). The trainer stops after the followed run's last step.

The ledger (``<ns>.trainer.steps``, schemas/steps.py): every committed step's covered records
with their verdict (trained, stale, duplicate, dlq, skipped) and ids. The step's records are
written to ``<checkpoint_dir>/train-steps/step-N.jsonl`` before its checkpoint is committed and
sent after its PolicyVersion, by a producer of their own, without waiting; a file is removed
once the broker acknowledged every part. A refused or unacknowledged send is logged and tried
again after the next step (and at the next start: files of steps past ``latest`` are removed,
the others sent), so the ledger never holds up or fails a step, and is at least once (readers
fold by coordinates: a record twice is a no-op). Stale drops always belong to a step: a
drop-only commit lists its records under the step it was made over.

Stopping (SIGTERM, ``stop()``): the loop returns after the current step. From the stop on,
every wait for the broker (the step's PolicyVersion, the dead letters before a drop-only
commit, and in ``close`` the PolicyVersion and the ledger) shares one budget of
``STOP_FLUSH_S`` (3 s), counted from the first of them; what is not delivered then is logged
and is not an error: the checkpoint is committed, so the next start publishes the missing
version and sends the spooled ledger (records after the checkpoint are read again). A
stopping trainer commits the group's offsets (lag only) only after a delivered PolicyVersion,
and not after a drop-only commit: a commit the broker does not answer holds the consumer's
close for its session timeout. A close after an error gets the same 3 s.

Debug hook (crash tests): ``ROLLSTREAM_TRAIN_DEBUG_PAUSE=STAGE:STEP`` makes the trainer write
``<checkpoint_dir>/debug-paused.json`` and sleep ``train_debug_pause_s`` at STAGE of step STEP:
``optimizer`` (weights updated in memory, nothing written), ``checkpoint`` (checkpoint written
to its temp dir, not committed), ``committed`` (committed, not published), ``published``.

Settings: ``settings.TrainerSettings``; the step (model, optimizer, ``train_step``): step.py;
both re-exported here, as is ``last_published_version`` of the policy topic (publisher.py:
``PolicyPublisher`` publishes each committed step's PolicyVersion). ``rollstream train`` runs
``main``.

Errors (rollstream.consumers.errors): ``TrainerError`` (a PolicyVersion that could not be
published, a bad setting); also raised through run: ``CheckpointError``, ``SourceError``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from rollstream.adapters.codecs import build_codec
from rollstream.consumers.errors import SourceError, TrainerError
from rollstream.consumers.training.batching import (
    StalenessFilter,
    TokenBudgetBatcher,
    TrainedIds,
    collate,
)
from rollstream.consumers.training.checkpoint import (
    Checkpoint,
    CheckpointMeta,
    CheckpointStore,
    Manifest,
    read_manifests,
)
from rollstream.consumers.training.dataset import Polled, SampleSource
from rollstream.consumers.training.ledger import StepLedger
from rollstream.consumers.training.loggers import build_loggers, log_all
from rollstream.consumers.training.metrics import TrainerMetrics
from rollstream.consumers.training.publisher import PolicyPublisher, last_published_version
from rollstream.consumers.training.retrain_plan import ManifestFollower
from rollstream.consumers.training.settings import DEBUG_STAGES, TRAINER_GROUP, TrainerSettings
from rollstream.consumers.training.step import build_optimizer, load_policy, train_step
from rollstream.schemas import (
    StepSample,
    TrainStep,
    Verdict,
    step_records,
)

__all__ = [
    "DEBUG_STAGES",
    "TRAINER_GROUP",
    "TrainResult",
    "Trainer",
    "TrainerError",
    "TrainerSettings",
    "build_optimizer",
    "last_published_version",
    "load_policy",
    "main",
    "run",
    "train_step",
]

log = logging.getLogger("rollstream.trainer")

STOP_FLUSH_S = 3.0  # after a stop: how long the broker is waited for, all flushes together


@dataclass
class TrainResult:
    step: int  # total steps = policy version of the latest weights
    steps_run: int  # steps made by this run
    resumed_from: int | None  # the checkpoint step this run started from
    samples_trained: int
    tokens_trained: int
    stale_dropped: int
    dlq: int
    checkpoint: Path | None
    wall_s: float
    metrics: dict[str, float] = field(default_factory=dict)  # of the last step
    duplicates_dropped: int = 0  # samples whose sample_id was trained before


# ---- the loop ---------------------------------------------------------------------------------


@dataclass
class _Window:
    """Records covered by closed batches since the last committed step, and the staleness
    filter that counted them."""

    filter: StalenessFilter
    stale: list[Polled] = field(default_factory=list)
    dlq: list[Polled] = field(default_factory=list)
    duplicates: list[Polled] = field(default_factory=list)
    skipped: list[Polled] = field(default_factory=list)  # following: in no step to come


def _coords(entries: list[Polled]) -> list[tuple[int, int]]:
    return [(e.partition, e.offset) for e in entries]


class Trainer:
    """One trainer process: model, optimizer, checkpoint store, sample source, producer."""

    def __init__(
        self,
        settings: TrainerSettings,
        *,
        on_step: Callable[[CheckpointMeta], None] | None = None,
    ) -> None:
        """``on_step(meta)`` runs after each committed and published step (progress)."""
        self.settings = s = settings
        self.on_step = on_step
        self.pause_at = s.debug_pause()
        if s.train_torch_threads:
            torch.set_num_threads(s.train_torch_threads)
        torch.manual_seed(s.train_seed)
        self.device = torch.device(s.train_device)
        self.loss_config = s.loss_config()
        self.topics = s.topics()
        self.codec = build_codec(s)
        self.store = CheckpointStore(
            s.resolved_checkpoint_dir(), keep=s.checkpoint_keep, fsync=s.checkpoint_fsync
        )
        self.model = load_policy(s)
        self.optimizer = build_optimizer(self.model, s)
        self.latest: Checkpoint | None = self.store.latest()
        self.step = 0
        self.samples_trained = 0
        self.tokens_trained = 0
        self.counters = dict.fromkeys(
            ("stale_dropped", "stale_tokens", "dlq", "duplicates_dropped"), 0.0
        )
        self.trained_ids = TrainedIds(s.train_dedup_window)
        self.offsets: dict[int, int] = {}  # samples topic: next offset per partition
        self.resumed_from: int | None = None
        self.metrics = TrainerMetrics()
        if self.latest is not None:
            meta = self.store.restore(self.latest, self.model, self.optimizer)
            self.metrics.resume(meta)
            self.step = meta.step
            self.samples_trained, self.tokens_trained = meta.samples_trained, meta.tokens_trained
            self.counters.update(meta.counters)
            self.offsets = dict(meta.offsets.get(self.topics.samples, {}))
            self.trained_ids = TrainedIds(s.train_dedup_window, self.store.trained_ids(self.latest))
            self.resumed_from = meta.step
            log.info("resumed from %s (step %d)", self.latest.path, meta.step)
        self.follower: ManifestFollower[Polled] | None = None
        if s.train_follow is not None:
            steps = {k: m.trained_ids for k, m in read_manifests(s.train_follow)}
            self.follower = ManifestFollower(steps, after=self.step)
            log.info("following %s: steps %d..%d", s.train_follow, self.step + 1,
                     self.follower.last_step)  # fmt: skip
        self.loggers = build_loggers(s)  # TensorBoard / W&B when asked for (loggers.py)
        self.source = SampleSource(
            s,
            group_id=self.topics.name(s.train_group_id),  # namespaced, like the topics
            instance_id=s.train_instance_id,
            positions=lambda: self.offsets,
            start=s.train_start,
            max_tokens=s.train_token_budget,
            session_timeout_ms=s.train_session_timeout_ms,
            max_poll_interval_ms=s.train_max_poll_interval_ms,
            stage="trainer",
            codec=self.codec,
        )
        self.publisher = PolicyPublisher(
            s, self.codec, self._stop_wait, stopping=lambda: self._stopped_at is not None
        )
        self.ledger = StepLedger(
            self.store.root, self.topics.trainer_steps, s.kafka_config(), fsync=s.checkpoint_fsync
        )
        drops = 0 if self.latest is None else self.latest.meta.drop_commits
        self.ledger.forget_after(self.step, drops)  # spooled, never committed
        self._stop = False
        self._stopped_at: float | None = None  # monotonic time of the stop request
        self._stop_deadline: float | None = None  # of the flushes after it (_stop_wait)
        self._reset()
        self.metrics_server = self.metrics.serve(s)

    # -- state of the open batch and the uncommitted window

    def _reset(self) -> None:
        """Forget everything read since the last committed step (it will be read again)."""
        self.batcher = TokenBudgetBatcher(
            self.settings.train_token_budget, self.settings.train_batch_samples
        )
        self.pending: list[Polled] = []  # records of the open batch, in arrival order
        self.pending_ids: set[str] = set()  # sample ids the open batch's batcher holds
        self.window = _Window(StalenessFilter(self.settings.train_max_staleness))
        self.followed: list[tuple[Polled, bool]] = []  # following: (record, held) since commit
        if self.follower is not None:
            self.follower.reset(self.step)
        self.generation = self.source.generation
        for partition, offset in self.source.assignment.items():
            if offset >= 0:  # a resolved start (train_start=latest): later checkpoints keep it
                self.offsets.setdefault(partition, offset)

    def stop(self) -> None:
        """Ask the loop to return after the current step (signal handlers call this); from
        here on the broker gets ``STOP_FLUSH_S`` in all (``_stop_wait``)."""
        self._stop = True
        if self._stopped_at is None:
            self._stopped_at = time.monotonic()

    def _stop_wait(self) -> float | None:
        """Seconds left for the broker after a stop (None: not stopping): ``STOP_FLUSH_S``
        counted from the first wait after the stop, for every wait together."""
        if self._stopped_at is None:
            return None
        now = time.monotonic()
        if self._stop_deadline is None:
            self._stop_deadline = max(now, self._stopped_at) + STOP_FLUSH_S
        return max(0.0, self._stop_deadline - now)

    def _done(self) -> bool:
        max_steps = self.settings.train_max_steps
        followed_all = self.follower is not None and self.follower.finished
        return self._stop or followed_all or (max_steps is not None and self.step >= max_steps)

    def run(self) -> TrainResult:
        s = self.settings
        started = time.monotonic()
        first_step = self.step
        self.publisher.publish_missing(self.latest)
        self.ledger.send()
        last_activity = time.monotonic()
        while not self._done():
            records = self.source.fetch(s.train_poll_records, s.train_poll_timeout_s)
            now = time.monotonic()
            if self.source.generation != self.generation:
                self._reset()  # partitions moved: they were sought back to our offsets
                last_activity = now
            if records:
                last_activity = now
                for msg in records:
                    self._intake(self.source.decode(msg))
                    if self._done():
                        break
                continue
            idle = now - last_activity
            if self.pending and s.train_flush_idle_s is not None and idle >= s.train_flush_idle_s:
                self.batcher.flush()
                self._close_batch(self._take_pending())
            elif (
                self.batcher.pending == 0  # records no step trains may be pending
                and s.train_exit_idle_s is not None
                and self.source.assignment
                and idle >= s.train_exit_idle_s
            ):
                if self.follower is not None and not self.follower.finished:
                    missing = self.follower.missing()
                    log.warning("idle at step %d: step %d waits for %d samples (%s)", self.step,
                                self.step + 1, len(missing), ", ".join(missing[:5]))  # fmt: skip
                break
        moved = self.source.generation != self.generation  # pending is read again then
        if self.pending and self.batcher.pending == 0 and not moved:
            self._close_batch(self._take_pending())  # a drop-only commit: nothing to train
        return TrainResult(
            step=self.step,
            steps_run=self.step - first_step,
            resumed_from=self.resumed_from,
            samples_trained=self.samples_trained,
            tokens_trained=self.tokens_trained,
            stale_dropped=int(self.counters["stale_dropped"]),
            dlq=int(self.counters["dlq"]),
            checkpoint=None if self.latest is None else self.latest.model_dir,
            wall_s=time.monotonic() - started,
            metrics=dict(self.latest.meta.metrics) if self.latest is not None else {},
            duplicates_dropped=int(self.counters["duplicates_dropped"]),
        )

    def _take_pending(self) -> list[Polled]:
        covered, self.pending, self.pending_ids = self.pending, [], set()
        return covered

    def _intake(self, rec: Polled) -> None:
        if self.follower is not None:
            self._follow(rec, self.follower)
            return
        sample = rec.sample
        duplicate = sample is not None and (
            sample.sample_id in self.pending_ids or sample.sample_id in self.trained_ids
        )
        # a sample already too stale for the step it would join takes no room in the batch
        # either (the step's version cannot change before that batch closes), so a step trains
        # its full count of fresh samples; _close_batch counts it as stale
        stale = sample is not None and (
            self.step - sample.policy_version > self.settings.train_max_staleness
        )
        if sample is not None and not duplicate and not stale:  # neither takes token budget
            closed = self.batcher.add(sample)
            if closed is not None and closed[-1] is sample:  # the count cap: this one completes
                self.pending_ids.add(sample.sample_id)  # the batch, every record up to it
                self.pending.append(rec)
                self._close_batch(self._take_pending())
                return
            if closed is not None:  # the token budget: the batch is every record before this one
                self._close_batch(self._take_pending())
            self.pending_ids.add(sample.sample_id)
        self.pending.append(rec)

    def _follow(self, rec: Polled, follower: ManifestFollower[Polled]) -> None:
        """Hold a record a step to come trains; train the next step once it is complete."""
        sample = rec.sample
        held = (
            sample is not None
            and sample.sample_id not in self.trained_ids
            and follower.add(sample.sample_id, rec)
        )
        self.followed.append((rec, held))
        while not self._done() and (kept := follower.ready()) is not None:
            self._train_followed(kept, follower)  # the steps after it may be complete too

    def _train_followed(self, kept: list[Polled], follower: ManifestFollower[Polled]) -> None:
        """Train a followed step: cover every record since the last step but those held."""
        trained = {id(e) for e in kept}
        kept_ids = {e.sample.sample_id for e in kept if e.sample is not None}
        covered: list[Polled] = []
        left: list[tuple[Polled, bool]] = []
        for e, was_held in self.followed:
            if id(e) in trained:
                covered.append(e)
            elif was_held:  # held for a later step: stays, and bounds the offsets
                left.append((e, was_held))
            else:
                covered.append(e)
                sid = None if e.sample is None else e.sample.sample_id
                if sid is None:
                    self.window.dlq.append(e)
                elif sid in self.trained_ids or sid in kept_ids or sid in follower.held:
                    self.window.duplicates.append(e)  # a copy of a trained or held sample
                else:
                    self.window.skipped.append(e)  # no step to come trains it
        self.followed = left
        self._train(kept, covered)

    def _close_batch(self, covered: list[Polled]) -> None:
        """Drop duplicates (the intake's decision, made again), filter the rest by staleness,
        and train on what is left; with nothing left, make a drop-only commit."""
        version = self.step  # the weights this step updates
        kept: list[Polled] = []
        seen: set[str] = set()
        for e in covered:
            if e.sample is None:
                self.window.dlq.append(e)
            elif e.sample.sample_id in seen or e.sample.sample_id in self.trained_ids:
                self.window.duplicates.append(e)
            else:
                seen.add(e.sample.sample_id)
                if self.window.filter.keep(e.sample, version):
                    kept.append(e)
                else:
                    self.window.stale.append(e)
        if kept:
            self._train(kept, covered)
        else:
            self._commit_drops()

    def _train(self, kept: list[Polled], covered: list[Polled]) -> None:
        """One optimizer step on the kept samples, then commit it with everything covered."""
        t0 = time.perf_counter()
        samples = [e.sample for e in kept if e.sample is not None]
        batch = {k: v.to(self.device) for k, v in collate(samples).items()}
        metrics = train_step(
            self.model, self.optimizer, batch, self.loss_config, self.settings.train_max_grad_norm
        )
        step = self.step + 1
        self._debug_pause("optimizer", step)
        metrics["padded_tokens"] = float(batch["input_ids"].numel())
        metrics["step_time_s"] = time.perf_counter() - t0
        meta = self._step_meta(step, kept, covered, metrics)
        self._commit(meta, [x.sample_id for x in samples], self._ledger_records(step, kept))

    def _ledger_records(self, step: int, kept: list[Polled]) -> list[TrainStep]:
        """The step's TrainStep records: every covered record with its verdict."""
        w = self.window
        verdicts: tuple[tuple[Verdict, list[Polled]], ...] = (
            ("trained", kept), ("stale", w.stale), ("duplicate", w.duplicates), ("dlq", w.dlq),
            ("skipped", w.skipped),
        )  # fmt: skip
        entries = [
            StepSample.of(v, e.partition, e.offset, e.sample) for v, es in verdicts for e in es
        ]
        return step_records(
            step, policy_version=step, ts=time.time(), topic=self.topics.samples, samples=entries
        )

    def _window_offsets(self, covered: list[Polled]) -> dict[int, int]:
        """The next offset per partition past every record of the window and ``covered``."""
        window = self.window
        offsets = dict(self.offsets)
        for e in window.stale + window.dlq + window.duplicates + window.skipped + covered:
            offsets[e.partition] = max(offsets.get(e.partition, 0), e.offset + 1)
        for e, _ in self.followed:  # following: records held for a later step are read again
            if e.partition in offsets:
                offsets[e.partition] = min(offsets[e.partition], e.offset)
        return offsets

    def _window_counters(self) -> dict[str, float]:
        """The cumulative counters with the window's drops added."""
        window = self.window
        counters = dict(self.counters)
        counters["stale_dropped"] += window.filter.dropped
        counters["stale_tokens"] += window.filter.dropped_tokens
        counters["dlq"] += len(window.dlq)
        counters["duplicates_dropped"] += len(window.duplicates)
        if window.skipped:
            counters["follow_skipped"] = counters.get("follow_skipped", 0.0) + len(window.skipped)
        counters["max_staleness_seen"] = max(
            counters.get("max_staleness_seen", 0.0), float(window.filter.max_seen_staleness)
        )
        return counters

    def _step_meta(
        self, step: int, kept: list[Polled], covered: list[Polled], metrics: dict[str, float]
    ) -> CheckpointMeta:
        """The checkpoint metadata of a step: offsets past every covered record, counters."""
        window = self.window
        offsets = self._window_offsets(covered)
        samples = [e.sample for e in kept if e.sample is not None]
        tokens = sum(len(x.input_ids) for x in samples)
        counters = self._window_counters()
        counters["skipped_steps"] = counters.get("skipped_steps", 0.0) + metrics["skipped"]
        metrics |= {
            "batch_samples": float(len(samples)),
            "batch_tokens": float(tokens),
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "stale_dropped_step": float(window.filter.dropped),
            "dlq_step": float(len(window.dlq)),
            "duplicates_step": float(len(window.duplicates)),
            "policy_version_min": float(min(x.policy_version for x in samples)),
            **counters,
        }
        topic = self.topics.samples
        return CheckpointMeta(
            step=step,
            policy_version=step,
            offsets={topic: offsets},
            samples_trained=self.samples_trained + len(samples),
            tokens_trained=self.tokens_trained + tokens,
            counters=counters,
            metrics=metrics,
            manifest=Manifest(
                topic,
                *map(_coords, (kept, window.stale, window.dlq, window.duplicates)),
                trained_ids=[x.sample_id for x in samples],
                skipped=_coords(window.skipped),
            ),
            base_model=str(self.settings.resolved_model_path()),
            train_config=self.settings.train_config(),
        )

    def _commit(self, meta: CheckpointMeta, sample_ids: list[str], ledger: list[TrainStep]) -> None:
        """Checkpoint (atomic) with the duplicate window grown by ``sample_ids`` (the step's
        trained samples), then publish the PolicyVersion, then send the step's ``ledger``
        (spooled before the checkpoint), then commit group offsets."""
        s, step = self.settings, meta.step
        self.source.flush()  # dead letters are durable before offsets move past them
        self.ledger.spool(step, ledger)  # a start forgets it unless the checkpoint commits
        # the window as of this step; if the save fails the trainer stops (run raises) and a
        # restart reads the window of the last committed step
        for sample_id in sample_ids:
            self.trained_ids.add(sample_id)
        ckpt = self.store.save(
            meta,
            self.model,
            self.optimizer,
            copy_from=s.resolved_model_path(),
            before_commit=lambda _tmp: self._debug_pause("checkpoint", step),
            trained_ids=self.trained_ids.keys(),
        )
        # committed: from here on this is the trainer's state
        self.latest, self.step = ckpt, step
        self.offsets = meta.offsets[self.topics.samples]
        self.samples_trained, self.tokens_trained = meta.samples_trained, meta.tokens_trained
        self.counters = dict(meta.counters)
        self.metrics.observe_step(meta)
        self.loggers = log_all(self.loggers, meta)
        self.window = _Window(StalenessFilter(s.train_max_staleness))
        self._debug_pause("committed", step)
        published = self.publisher.publish(ckpt)
        self.ledger.send()
        self._debug_pause("published", step)
        if s.train_commit_offsets and published:  # (see PolicyPublisher.publish)
            self.source.commit(self.offsets)
        if self.on_step is not None:
            self.on_step(meta)
        m = meta.metrics
        log.info("step %d: %d samples, %d tokens, loss %.4f, %.3fs", step, m["batch_samples"],
                 m["batch_tokens"], m["loss"], m["step_time_s"])  # fmt: skip

    def _commit_drops(self) -> None:
        """A drop-only commit (module docstring): the window's records, none of them trained,
        committed over the latest step; no step, no PolicyVersion."""
        w, latest = self.window, self.latest
        if latest is None or not (w.stale or w.dlq or w.duplicates or w.skipped):
            return  # before the first step: the window waits for step 1
        old, topic = latest.meta, self.topics.samples
        before = old.manifest if old.manifest is not None and old.manifest.topic == topic else None
        before = before or Manifest(topic)  # (a step copied from another namespace: retrain)
        meta = replace(
            old,
            offsets={topic: self._window_offsets([])},
            counters=self._window_counters(),
            manifest=Manifest(
                topic,
                before.trained,
                before.stale + _coords(w.stale),
                before.dlq + _coords(w.dlq),
                before.duplicate + _coords(w.duplicates),
                trained_ids=before.trained_ids,
                skipped=before.skipped + _coords(w.skipped),
            ),
            drop_commits=old.drop_commits + 1,
        )
        stop_wait = self._stop_wait()
        try:  # dead letters are durable before offsets move past them
            self.source.flush(30.0 if stop_wait is None else stop_wait)
        except SourceError as exc:
            if stop_wait is None:
                raise
            left = len(w.stale) + len(w.dlq) + len(w.duplicates)
            log.warning("stopping: %s; %d records read again at the next start", exc, left)
            return
        self.ledger.spool(meta.step, self._ledger_records(meta.step, []), meta.drop_commits)
        self.latest = self.store.commit_drops(meta)
        # committed: from here on this is the trainer's state
        self.offsets = meta.offsets[topic]
        self.counters = dict(meta.counters)
        self.metrics.resume(meta)
        self.window = _Window(StalenessFilter(self.settings.train_max_staleness))
        self.ledger.send()
        # group offsets are for lag only: not while stopping (see PolicyPublisher.publish)
        if self.settings.train_commit_offsets and stop_wait is None:
            self.source.commit(self.offsets)
        log.info(
            "step %d: %d stale, %d duplicate, %d dead-lettered records committed without a new "
            "step (drop-only commit %d)",
            meta.step,
            len(w.stale),
            len(w.duplicates),
            len(w.dlq),
            meta.drop_commits,
        )

    # -- debug hook

    def _debug_pause(self, stage: str, step: int) -> None:
        if self.pause_at != (stage, step):
            return
        marker = self.store.root / "debug-paused.json"
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(json.dumps({"stage": stage, "step": step, "pid": os.getpid()}))
        os.replace(tmp, marker)
        log.warning("debug pause at %s of step %d", stage, step)
        time.sleep(self.settings.train_debug_pause_s)

    def close(self, *, failed: bool = False) -> None:
        """Deliver what is queued (a PolicyVersion, the ledger) and release everything. After
        a stop the broker gets what ``_stop_wait`` leaves, after an error (``failed``)
        ``STOP_FLUSH_S``, for both together; what is left is logged (a restart publishes the
        committed version and sends the spooled ledger). Otherwise
        ``train_publish_timeout_s`` (the ledger 10 s at most)."""
        s = self.settings
        try:
            stop_wait = self._stop_wait()
            if stop_wait is None and not failed:
                self.publisher.close(None, self.latest)
                self.ledger.close(min(s.train_publish_timeout_s, 10.0))
                return
            wait = STOP_FLUSH_S if stop_wait is None else stop_wait
            deadline = time.monotonic() + wait
            self.publisher.close(wait, self.latest)
            self.ledger.close(max(0.0, deadline - time.monotonic()))
        finally:
            self.source.close()
            for lg in self.loggers:
                with contextlib.suppress(Exception):  # a side channel: never blocks the close
                    lg.close()
            if self.metrics_server is not None:
                self.metrics_server.stop()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(failed=exc_type is not None)


def run(
    settings: TrainerSettings, *, on_step: Callable[[CheckpointMeta], None] | None = None
) -> TrainResult:
    """Train until ``train_max_steps``, ``train_exit_idle_s`` of idleness, the followed run's
    last step (``train_follow``), or ``stop()``. ``on_step(meta)`` runs after each step."""
    with Trainer(settings, on_step=on_step) as trainer:
        return trainer.run()


def main(settings: TrainerSettings) -> int:
    """``rollstream train``: ``run`` with SIGTERM and SIGINT stopping it after the current step;
    prints the TrainResult as one JSON line on stdout."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no per-checkpoint progress bars in the trainer's log
    with Trainer(settings) as trainer:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: trainer.stop())
        result = trainer.run()
    print(json.dumps(asdict(result), default=str), file=sys.stdout, flush=True)
    return 0
