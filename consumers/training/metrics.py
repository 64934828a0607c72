"""The trainer's metrics (``rollstream_trainer_*``, docs/metrics.md), from its committed steps.

    metrics = TrainerMetrics()
    server = metrics.serve(settings)       # /metrics, /livez, /readyz on metrics_port (or None)
    metrics.resume(meta)                   # the checkpoint restored at start: its totals
    metrics.observe_step(meta)             # each committed checkpoint's CheckpointMeta

Everything comes from ``CheckpointMeta``: ``metrics`` (of the step: loss, clip_frac, approx_kl,
grad_norm, step_time_s, batch sizes, ...) and ``counters`` (cumulative: stale_dropped, dlq,
duplicates_dropped, ...). A cumulative counter is exported as a Prometheus counter that follows
it, so a trainer resumed from a checkpoint goes on from the checkpoint's totals rather than
from zero. Live while the process answers (a trainer may wait for samples for hours: no
heartbeat); ready once ``serve`` was called, i.e. the trainer is built and restored.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

from rollstream.adapters.metrics import MetricsServer, ServiceMetrics, serve_metrics
from rollstream.consumers.training.checkpoint import CheckpointMeta
from rollstream.schemas.settings import CommonSettings

__all__ = ["TrainerMetrics"]

# step metrics exported as gauges of the last step: (metrics key, metric name, help)
_LAST_STEP = (
    ("loss", "loss", "PPO loss of the last step"),
    ("clip_frac", "clip_fraction", "share of tokens whose ratio was clipped, last step"),
    ("approx_kl", "approx_kl", "k3 estimate of KL(behaviour || current), last step"),
    ("grad_norm", "grad_norm", "gradient norm before clipping, last step"),
    ("lr", "learning_rate", "learning rate of the last step"),
    ("batch_samples", "batch_samples", "samples in the last step's batch"),
    ("batch_tokens", "batch_tokens", "tokens in the last step's batch"),
    ("max_staleness_seen", "max_staleness", "largest staleness seen (policy versions)"),
)
# cumulative counters of CheckpointMeta.counters -> dropped_samples{reason}
_DROPPED = (("stale_dropped", "stale"), ("dlq", "dlq"), ("duplicates_dropped", "duplicate"))


class TrainerMetrics:
    """Prometheus metrics of one trainer, fed with each committed step's CheckpointMeta."""

    def __init__(self) -> None:
        self.service = m = ServiceMetrics("trainer")
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._totals: dict[str, float] = {}
        self.step_seconds = m.histogram("step_seconds", "one optimizer step (forward..AdamW)")
        self.staleness = m.histogram(
            "staleness",
            "policy versions between a step's oldest sample and the step",
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
        )
        m.counter_fn("steps", "optimizer steps committed", lambda: self._total("steps"))
        m.counter_fn("samples_trained", "samples trained", lambda: self._total("samples"))
        m.counter_fn("tokens_trained", "tokens trained", lambda: self._total("tokens"))
        m.counter_fn("skipped_steps", "steps skipped (gradient not finite)", self._skipped)
        m.counter_fn(
            "dropped_samples", "samples not trained, by reason", self._dropped, ("reason",)
        )
        m.gauge_fn("step", "the last committed step", lambda: self._total("step"))
        m.gauge_fn("policy_version", "the last published version", lambda: self._total("version"))
        for key, name, doc in _LAST_STEP:
            m.gauge_fn(name, doc, self._reader(key))
        m.health.set("trainer", False, "starting")

    def _total(self, name: str) -> float:
        with self._lock:
            return self._totals.get(name, 0.0)

    def _skipped(self) -> float:
        return self._total("skipped_steps")

    def _dropped(self) -> dict[tuple[str, ...], float]:
        with self._lock:
            return {(reason,): self._totals.get(key, 0.0) for key, reason in _DROPPED}

    def _reader(self, key: str) -> Callable[[], dict[tuple[str, ...], float]]:
        def read() -> dict[tuple[str, ...], float]:
            with self._lock:
                value = self._last.get(key)
            return {} if value is None or not math.isfinite(value) else {(): value}

        return read

    def observe_step(self, meta: CheckpointMeta) -> None:
        """One committed step: its timings and losses, and the checkpoint's totals."""
        m = meta.metrics
        if "step_time_s" in m:
            self.step_seconds.observe(m["step_time_s"])
        if "policy_version_min" in m:
            self.staleness.observe(max(0.0, meta.policy_version - 1 - m["policy_version_min"]))
        self.resume(meta)
        self.service.health.set("trainer", True, f"step {meta.step}")

    def resume(self, meta: CheckpointMeta) -> None:
        """The totals and last-step values of ``meta`` (a restored checkpoint: no timings)."""
        with self._lock:
            self._last = dict(meta.metrics)
            self._totals.update(
                {key: float(meta.counters.get(key, 0.0)) for key, _ in _DROPPED}
                | {
                    "skipped_steps": float(meta.counters.get("skipped_steps", 0.0)),
                    "steps": float(meta.step),
                    "step": float(meta.step),
                    "version": float(meta.policy_version),
                    "samples": float(meta.samples_trained),
                    "tokens": float(meta.tokens_trained),
                }
            )

    def serve(self, settings: CommonSettings) -> MetricsServer | None:
        """/metrics, /livez and /readyz on ``settings.metrics_port`` (None when unset); the
        trainer is ready from here on."""
        with self._lock:
            step = int(self._totals.get("step", 0))
        self.service.health.set("trainer", True, f"step {step}")
        return serve_metrics(settings, self.service)
