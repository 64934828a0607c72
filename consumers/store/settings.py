"""Settings of the ClickHouse sink loop: ``ROLLSTREAM_SINK_*`` plus the common ones.

``rollstream sink`` runs the loop with the analytics server beside it; that deployable's
settings are ``rollstream.consumers.analytics.service.SinkServiceSettings``, which adds the
``ROLLSTREAM_ANALYTICS_*`` settings to these.
"""

from __future__ import annotations

from typing import Literal

from rollstream.consumers.store.chstore import database_for
from rollstream.schemas import CommonSettings

__all__ = ["SinkSettings", "SinkTopic"]

SinkTopic = Literal["events", "trajectories", "samples", "policy"]


class SinkSettings(CommonSettings):
    """The ClickHouse sink loop (``rollstream sink`` runs it; see also SinkServiceSettings)."""

    sink_group_id: str = "rollstream-sink-v1"  # consumer group (prefixed with the namespace)
    sink_instance_id: str | None = None  # Kafka static membership: restarts skip the rebalance
    sink_topics: list[SinkTopic] = ["events", "trajectories", "samples", "policy"]  # read these
    sink_batch_messages: int = 20_000  # N: batches never cross a multiple of N offsets
    sink_batch_bytes: int = 32 << 20  # ... nor this many value bytes
    sink_flush_interval_s: float = 1.0  # a caught-up partial batch this old is flushed (intent)
    sink_flush_max_wait_s: float = 60.0  # ... and any partial batch this old
    sink_poll_messages: int = 10_000  # at most this many messages per poll
    sink_poll_timeout_s: float = 0.2  # wait this long for a message when none is queued
    sink_session_timeout_ms: int = 6_000  # Kafka session.timeout.ms
    sink_max_poll_interval_ms: int = 300_000  # Kafka max.poll.interval.ms
    sink_max_partition_fetch_bytes: int = 8 << 20  # Kafka max.partition.fetch.bytes
    sink_pipeline_depth: int = 4  # mapped batches waiting for the writer thread
    sink_map_workers: int = 0  # processes that decode + map batches (0: the consume loop)
    sink_insert_retry_s: float = 120.0  # retry a failing (transport) insert, then exit
    sink_stats_interval_s: float = 30.0  # counters in the log this often (0: never)
    sink_log_level: str = "info"  # the sink's loggers (debug: every insert and commit)
    sink_debug_commit_delay_s: float = 0.0  # tests: widen the insert -> commit window

    @property
    def group_id(self) -> str:
        return self.topics().name(self.sink_group_id)

    @property
    def database(self) -> str:
        return database_for(self.namespace)

    def topic_names(self) -> dict[str, str]:
        """Kafka topic -> contract name (events, trajectories, samples, policy)."""
        topics = self.topics()
        return {getattr(topics, name): name for name in self.sink_topics}
