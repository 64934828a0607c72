"""Settings shared by every deployable: how to reach Kafka, ClickHouse and the registry.

Each deployable (stack, recorder, proxy, processor, sink, trainer) has one pydantic-settings
class that extends ``CommonSettings``; all read ``ROLLSTREAM_*`` variables (see
docs/configuration.md). They are built in ``main()`` and passed down; nothing else reads the
environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from .topics import Topics

__all__ = ["CommonSettings", "kafka_client_config"]


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ROLLSTREAM_", extra="ignore")

    kafka_bootstrap: str = "127.0.0.1:9092"  # bootstrap servers; the local broker listens here
    kafka_security_protocol: str = "PLAINTEXT"  # PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL
    kafka_sasl_mechanism: str | None = None  # PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, ...
    kafka_sasl_username: str | None = None  # SASL user
    kafka_sasl_password: SecretStr | None = None  # SASL password (secret)
    kafka_ssl_ca_location: str | None = None  # CA bundle for TLS
    namespace: str = ""  # topic prefix: `ns.rollout.events`; replays run beside live data
    topic_replication: int = 1  # replication factor of the topics the manager creates
    schema_registry_url: str | None = None  # Confluent-API registry: 00+id framing; registry extra
    clickhouse_url: str = "chdb://.rollstream/clickhouse"  # chDB path or http(s):// server
    home: Path = Path(".rollstream")  # local state: broker data, models, checkpoints, logs
    # /metrics, /livez, /readyz of a service that serves no HTTP of its own (docs/metrics.md):
    metrics_port: int | None = Field(default=None, ge=0, le=65535)  # None: not served; 0: any
    metrics_host: str = Field(default="127.0.0.1", min_length=1, max_length=253)  # 0.0.0.0: all
    metrics_key: SecretStr | None = None  # when set, GET /metrics needs Bearer KEY (probes open)
    log_format: Literal["text", "json"] = "text"  # json: one object a line (ts, level, logger, ...)

    def topics(self) -> Topics:
        return Topics(self.namespace, replication=self.topic_replication)

    def kafka_config(self) -> dict[str, Any]:
        return kafka_client_config(self)


def kafka_client_config(s: CommonSettings) -> dict[str, Any]:
    """librdkafka connection settings (bootstrap, security); callers add their own."""
    conf: dict[str, Any] = {
        "bootstrap.servers": s.kafka_bootstrap,
        "security.protocol": s.kafka_security_protocol,
    }
    if s.kafka_sasl_mechanism:
        conf["sasl.mechanism"] = s.kafka_sasl_mechanism
    if s.kafka_sasl_username:
        conf["sasl.username"] = s.kafka_sasl_username
    if s.kafka_sasl_password is not None:
        conf["sasl.password"] = s.kafka_sasl_password.get_secret_value()
    if s.kafka_ssl_ca_location:
        conf["ssl.ca.location"] = s.kafka_ssl_ca_location
    return conf
