"""Settings of the analytics server: ``ROLLSTREAM_ANALYTICS_*`` plus the common ones.

The server runs in the process that owns the store (``rollstream sink``: chDB admits one
process per data path), so that deployable's settings class,
``analytics.service.SinkServiceSettings``, holds these and the sink's.
"""

from __future__ import annotations

from rollstream.consumers.store.chstore import database_for
from rollstream.schemas import CommonSettings

__all__ = ["AnalyticsSettings"]


class AnalyticsSettings(CommonSettings):
    """The analytics server (``rollstream sink`` serves it beside the sink loop)."""

    analytics_enabled: bool = True  # serve the analytics API in the sink process
    analytics_host: str = "127.0.0.1"  # analytics server address (--host)
    analytics_port: int = 8300  # analytics server port (--port; 0: any free port)
    analytics_max_execution_time_s: float = 30.0  # per query (max_execution_time)
    analytics_max_result_rows: int = 1_000_000  # per query; more is an error
    analytics_max_memory_bytes: int = 0  # 0: the engine's default

    @property
    def database(self) -> str:
        """The namespace's database: unqualified table names in queries are its tables."""
        return database_for(self.namespace)
