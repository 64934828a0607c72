"""Settings of the analytics server: ``ROLLSTREAM_ANALYTICS_*`` plus the common ones.

The server runs in the process that owns the store (``rollstream sink``: chDB admits one
process per data path), so that deployable's settings class,
``analytics.service.SinkServiceSettings``, holds these and the sink's.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import NoDecode

from rollstream.consumers.store.chstore import database_for
from rollstream.schemas import CommonSettings

__all__ = ["AnalyticsSettings"]

_MIB = 1024 * 1024


def _split_list(value: Any) -> Any:
    """``a,b`` or a JSON list (environment) or a list (code) -> list."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [v.strip() for v in text.split(",") if v.strip()]
    return value


class AnalyticsSettings(CommonSettings):
    """The analytics server (``rollstream sink`` serves it beside the sink loop). List settings
    accept a JSON list or a comma-separated string."""

    analytics_enabled: bool = True  # serve the analytics API in the sink process
    analytics_host: str = "127.0.0.1"  # analytics server address (--host)
    analytics_port: int = Field(8300, ge=0, le=65535)  # server port (--port; 0: any free port)
    # analyst keys (Authorization: Bearer KEY); unset: the analyst and admin keys of
    # <home>/keys.json; none there: the server is open (a warning at start)
    analytics_api_keys: Annotated[list[SecretStr], NoDecode] = Field(default_factory=list)
    analytics_max_execution_time_s: float = Field(30.0, gt=0, le=3600)  # per query
    analytics_max_result_rows: int = Field(1_000_000, ge=1, le=100_000_000)  # per query
    analytics_max_result_bytes: int = Field(256 * _MIB, ge=_MIB)  # per query, uncompressed
    analytics_max_memory_bytes: int = Field(2048 * _MIB, ge=0)  # per query; 0: engine default
    analytics_max_body_bytes: int = Field(_MIB, ge=1024, le=64 * _MIB)  # request body (413)

    _lists = field_validator("analytics_api_keys", mode="before")(_split_list)

    @property
    def database(self) -> str:
        """The namespace's database: unqualified table names in queries are its tables."""
        return database_for(self.namespace)
