"""``rollstream controller``: the elastic controller, live.

Every ``control_period_s`` it reads the run's signals from the log (signals.py says which and
how), asks the policy (policy.decide, the same function ``rollstream simulate`` plans with) for
a decision, and publishes it as a ``CapacityDecision`` on ``<ns>.control.decisions`` (acks=all):
the global RUN slots (staleness-aware admission: a rollout starts only while it can still be
trained within ``control_max_staleness`` versions), their split between the live RUN workers,
and the share of accelerators serving inference. The stage workers follow the newest decision
(producers/rollouts/capacity.py); every decision stays on the log with the signals it saw, so
a run's control is auditable and replayable.

Actuators here: the RUN workers' limits. ``inference_share`` is decided and recorded; on one
machine nothing moves accelerators, so it acts only through the RUN slots (docs/controller.md).

Metrics (``rollstream_controller_*``, docs/metrics.md) on ``metrics_port`` when set: decisions by
reason, periods without one, the last decision (run slots, admit, share) and the signals it
saw. Live while the loop goes round; ready once a decision was published.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Final

import httpx
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from pydantic import Field, SecretStr

from rollstream.adapters.codecs import build_codec
from rollstream.adapters.metrics import ServiceMetrics, serve_metrics
from rollstream.adapters.topics import TopicError, admin_client, group_lag, high_watermarks
from rollstream.consumers.control.policy import Decision, PolicyConfig, Signals, decide
from rollstream.consumers.control.signals import SignalBook, to_capacity
from rollstream.schemas import CommonSettings, DecodeError, PolicyVersion
from rollstream.schemas.control import DECISION_KEY, decode_report
from rollstream.schemas.errors import SchemaError

__all__ = ["ControlSettings", "Controller", "run"]

log = logging.getLogger("rollstream.consumers.control.controller")

POLL_S: Final = 0.1
CATCH_UP_S: Final = 10.0  # the longest a first decision waits for the policy topic
PUBLISH_TIMEOUT_S: Final = 10.0  # a decision's ack; cut short by a stop
STOP_FLUSH_S: Final = 2.0  # the last decision's ack at stop
STOP_GRACE_S: Final = 8.0  # SIGTERM / SIGINT -> exit, at most (a tick may wait on metadata)
TRAINER_GROUP: Final = "rollstream-trainer-v1"  # training.settings.TRAINER_GROUP (no torch here)


class ControlSettings(CommonSettings):
    control_period_s: float = Field(default=2.0, ge=0.1, le=600)  # between decisions
    control_ttl_s: float = Field(default=15.0, ge=1, le=3600)  # workers ignore older decisions
    control_max_staleness: int = Field(default=4, ge=0, le=1000)  # the trainer's bound
    control_admission: bool = True  # staleness-aware admission (off: every RUN slot open)
    control_samples_per_rollout: float = Field(default=1.0, gt=0, le=10_000)  # until measured
    control_samples_per_step: float = Field(default=64.0, gt=0, le=10**7)  # until a version
    control_trainer_group: str = TRAINER_GROUP  # the trainer's consumer group (namespaced)
    # the share of accelerators serving inference moves within [min, max]
    control_min_share: float = Field(default=0.1, ge=0, le=1)  # least inference_share
    control_max_share: float = Field(default=0.9, ge=0, le=1)  # most inference_share
    control_cooldown_s: float = Field(default=10.0, ge=0, le=3600)  # between share changes
    control_proxy_url: str | None = None  # the proxy whose served policy version is read
    control_proxy_admin_key: SecretStr | None = None  # its admin key (GET /v1/admin/status)

    def policy_config(self) -> PolicyConfig:
        return PolicyConfig(
            max_staleness=self.control_max_staleness,
            min_share=self.control_min_share,
            max_share=self.control_max_share,
            cooldown_s=self.control_cooldown_s,
            admission=self.control_admission,
        )


class Controller:
    """One controller of one namespace: ``tick`` reads, decides and publishes once."""

    def __init__(self, settings: ControlSettings) -> None:
        self.settings = settings
        self.topics = settings.topics()
        self.codec = build_codec(settings)
        self.config = settings.policy_config()
        self.book = SignalBook(
            settings.control_max_staleness,
            settings.control_samples_per_rollout,
            settings.control_samples_per_step,
        )
        self.previous: Decision | None = None
        self.signals: Signals | None = None  # what the last decision saw
        self.decisions = 0
        self.metrics = self._metrics()
        self.admin = admin_client(settings)
        base = {**settings.kafka_config(), "enable.auto.commit": False}
        self.reader = Consumer({**base, "group.id": f"rollstream-controller-{uuid.uuid4().hex}"})
        self.offsets = Consumer({**base, "group.id": f"rollstream-controller-{uuid.uuid4().hex}"})
        self.producer = Producer({**settings.kafka_config(), "acks": "all", "linger.ms": 0})
        self.stopping = threading.Event()  # set by ``run``'s stop: a pending publish gives up
        self._assign()

    def _metrics(self) -> ServiceMetrics:
        m = ServiceMetrics("controller")
        self.decided = m.counter("decisions", "decisions published, by reason", ("reason",))
        self.missed = m.counter("missed_periods", "periods without a decision (broker away)")

        def last(read: Callable[[Decision], float]) -> Callable[[], dict[tuple[str, ...], float]]:
            return lambda: {} if self.previous is None else {(): read(self.previous)}

        def seen(read: Callable[[Signals], float]) -> Callable[[], dict[tuple[str, ...], float]]:
            return lambda: {} if self.signals is None else {(): read(self.signals)}

        m.gauge_fn("run_slots", "RUN slots of the last decision", last(lambda d: d.run_slots))
        m.gauge_fn("admit", "rollouts the last decision let start", last(lambda d: d.admit))
        m.gauge_fn(
            "inference_share", "accelerator share for inference", last(lambda d: d.inference_share)
        )
        m.gauge_fn(
            "samples_waiting", "samples the trainer has not read", seen(lambda x: x.samples_waiting)
        )
        m.gauge_fn(
            "rollouts_in_flight", "rollouts admitted, no samples yet",
            seen(lambda x: x.rollouts_in_flight),
        )  # fmt: skip
        m.gauge_fn(
            "trained_version", "newest policy version published", seen(lambda x: x.trained_version)
        )

        def decided() -> tuple[bool, str]:
            d = self.previous
            return d is not None, "no decision yet" if d is None else d.reason

        m.health.watch("decisions", decided)
        return m

    def _assign(self) -> None:
        """Policy versions from the start (the last few matter); worker reports from the last
        few periods (a report older than 3 periods is dead anyway)."""
        policy, reports = self.topics.policy, self.topics.control_workers
        high = high_watermarks(self.offsets, reports)[0]
        since = int((time.time() - 60) * 1000)
        found = self.reader.offsets_for_times([TopicPartition(reports, 0, since)], timeout=10)
        start = found[0].offset if found and found[0].offset >= 0 else high
        self.reader.assign([TopicPartition(policy, 0, 0), TopicPartition(reports, 0, start)])
        self._policy_until = high_watermarks(self.offsets, policy)[0]
        self._caught_up = self._policy_until == 0

    def _catch_up(self) -> None:
        """Read the policy versions published before the controller started before deciding
        anything: a decision made without them would admit as if no trainer were waiting."""
        if self._caught_up:
            return
        deadline = time.monotonic() + CATCH_UP_S
        policy = TopicPartition(self.topics.policy, 0)
        while time.monotonic() < deadline:
            self._read()
            if self.reader.position([policy])[0].offset >= self._policy_until:
                self._caught_up = True
                return
        raise TopicError(
            f"{self.topics.policy} not read up to offset {self._policy_until} in {CATCH_UP_S} s"
        )

    def _read(self) -> None:
        for msg in self.reader.consume(1000, POLL_S):
            if msg.error() is not None:
                continue
            try:
                if msg.topic() == self.topics.policy:
                    record = self.codec.decode(msg.value() or b"", expect=PolicyVersion)
                    assert isinstance(record, PolicyVersion)
                    self.book.version(record)
                else:
                    self.book.report(decode_report(msg.value() or b""))
            except (DecodeError, SchemaError) as exc:
                log.warning("%s@%d: ignored: %s", msg.topic(), msg.offset() or 0, exc)

    def _lags(self) -> None:
        samples = high_watermarks(self.offsets, self.topics.samples)
        closed = high_watermarks(self.offsets, self.topics.trajectories)
        run = high_watermarks(self.offsets, self.topics.task("run"))
        trainer = self.topics.name(self.settings.control_trainer_group)
        run_group = self.topics.name("rollstream.rollouts.run")
        waiting = group_lag(self.admin, trainer, samples, self.topics.samples)
        run_lag = group_lag(self.admin, run_group, run, self.topics.task("run"))
        self.book.offsets(sum(samples.values()), sum(closed.values()), waiting, run_lag)

    def _serving(self) -> int | None:
        """The policy version the proxy serves (its admin status), when a proxy is configured:
        rollouts admitted before it reloads a new version are generated by the old one."""
        s = self.settings
        if s.control_proxy_url is None:
            return None
        key = s.control_proxy_admin_key
        headers = {"Authorization": f"Bearer {key.get_secret_value()}"} if key else {}
        try:
            resp = httpx.get(f"{s.control_proxy_url}/v1/admin/status", headers=headers, timeout=5)
            resp.raise_for_status()
            return int(resp.json().get("policy_version", 0))
        except (httpx.HTTPError, ValueError, TypeError) as exc:
            log.warning("the proxy's served version is unknown: %s", exc)
            return None

    def tick(self) -> Decision:
        self._catch_up()
        self._read()
        self._lags()
        serving = self._serving()
        now = time.time()
        share = self.previous.inference_share if self.previous is not None else 1.0
        period = now - self.previous.t if self.previous is not None else 0.0
        signals = self.book.signals(now, share, period)
        if serving is not None:
            signals = replace(signals, serving_version=min(serving, signals.trained_version))
        decision = decide(signals, self.config, self.previous)
        record = to_capacity(
            decision,
            signals,
            self.book.live(now),
            now,
            self.settings.control_ttl_s,
            limited=self.settings.control_admission,
        )
        self.producer.produce(
            self.topics.control_decisions, key=DECISION_KEY, value=record.encode()
        )
        deadline = time.monotonic() + PUBLISH_TIMEOUT_S
        while self.producer.flush(0.1) > 0:
            if self.stopping.is_set() or time.monotonic() > deadline:
                raise KafkaException("a decision was not acknowledged (not published)")
        if self.previous is None or (decision.run_slots, decision.reason) != (
            self.previous.run_slots,
            self.previous.reason,
        ):
            log.info(
                "run slots %d (admit %d, in flight %d, waiting %d samples, version %d): %s",
                decision.run_slots,
                decision.admit,
                signals.rollouts_in_flight,
                signals.samples_waiting,
                signals.trained_version,
                decision.reason,
            )
        self.previous, self.signals = decision, signals
        self.decisions += 1
        self.decided.labels(decision.reason).inc()
        return decision

    def close(self) -> None:
        with contextlib.suppress(KafkaException, RuntimeError):
            if left := self.producer.flush(STOP_FLUSH_S):
                log.warning("stopping: %d decision(s) not acknowledged: not published", left)
            self.reader.close()
            self.offsets.close()


def _exit_after(grace_s: float) -> None:
    """The stop's bound (a daemon thread): a tick still waiting on the broker ``grace_s`` after
    the signal ends the process with 0. The controller commits nothing and its decisions are
    state on the log, so an unpublished one is only a period without a decision."""
    time.sleep(grace_s)
    log.warning("stop not done %.0f s after the signal (the broker unreachable?): exiting; "
                "the decision of this period not published", grace_s)  # fmt: skip
    logging.shutdown()
    os._exit(0)


def run(
    settings: ControlSettings,
    *,
    stop: threading.Event | None = None,
    on_tick: Callable[[Decision], None] | None = None,
) -> int:
    """Decide every ``control_period_s`` until SIGTERM / SIGINT (or ``stop``). A tick that
    fails (the broker away) is logged and tried again next period."""
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():

        def on_signal(*_: object) -> None:
            if not stop.is_set():
                stop.set()
                threading.Thread(target=_exit_after, args=(STOP_GRACE_S,), daemon=True).start()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
    controller = Controller(settings)
    controller.stopping = stop
    health = controller.metrics.health
    health.stale_s = max(60.0, 5 * settings.control_period_s)
    metrics_server = serve_metrics(settings, controller.metrics)
    try:
        while not stop.is_set():
            t = time.monotonic()
            health.beat()
            try:
                decision = controller.tick()
                if on_tick is not None:
                    on_tick(decision)
            except (KafkaException, TopicError) as exc:
                controller.missed.inc()
                log.warning("no decision this period: %s", exc)
            stop.wait(max(settings.control_period_s - (time.monotonic() - t), 0.0))
        return 0
    finally:
        controller.close()
        if metrics_server is not None:
            metrics_server.stop()
