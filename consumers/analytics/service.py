"""``rollstream sink``: the ClickHouse sink loop with the analytics server beside it, in one
process. chDB admits one process per data path, so the process that owns the store is the one
that serves its queries; the store knows nothing of analytics, so the two are put together
here, above it.

    SinkServiceSettings     ROLLSTREAM_SINK_* (store.settings.SinkSettings) and
                            ROLLSTREAM_ANALYTICS_* (analytics.settings.AnalyticsSettings)
    run(settings) -> SinkStats      the sink loop (store.sink.run: topics, migrations, consume
                                    until SIGTERM/SIGINT) and, while it runs and
                                    ``analytics_enabled``, the analytics server

The process's metrics are the sink's (``rollstream_sink_*`` on ``metrics_port``, store/sink.py);
its readiness adds the check ``analytics`` (the server is up).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from rollstream.consumers.analytics.server import AnalyticsServer, serve
from rollstream.consumers.analytics.settings import AnalyticsSettings
from rollstream.consumers.store import sink as sink_loop
from rollstream.consumers.store.settings import SinkSettings
from rollstream.consumers.store.sink import Sink
from rollstream.consumers.store.stats import SinkStats

__all__ = ["SinkServiceSettings", "run"]

log = logging.getLogger(__name__)


class SinkServiceSettings(AnalyticsSettings, SinkSettings):
    """The ClickHouse sink deployable (``rollstream sink``): the sink loop's settings and its
    analytics server's."""


@contextlib.contextmanager
def _analytics(settings: AnalyticsSettings, sink: Sink) -> Iterator[AnalyticsServer]:
    """The analytics server for as long as the sink loop runs (its counters in /health)."""
    server = serve(settings, stats=sink.stats.as_dict)
    log.info("analytics at %s", server.url)
    sink.metrics.health.set("analytics", True, "serving")
    try:
        yield server
    finally:
        sink.metrics.health.set("analytics", False, "stopped")
        server.stop()


def run(settings: SinkServiceSettings) -> SinkStats:
    """Run the sink until SIGTERM / SIGINT, serving analytics beside it when enabled."""
    if not settings.analytics_enabled:
        return sink_loop.run(settings)
    return sink_loop.run(settings, beside=lambda sink: _analytics(settings, sink))
