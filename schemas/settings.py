"""Settings shared by every deployable: how to reach Kafka, ClickHouse and the registry.

Each deployable (stack, recorder, proxy, processor, sink, trainer) has one pydantic-settings
class that extends ``CommonSettings``; all read ``ROLLSTREAM_*`` variables (see
docs/configuration.md). They are built in ``main()`` and passed down; nothing else reads the
environment.

Keys: a setting of the ones in ``keys.FILLS`` (``proxy_api_keys``, ``model_api_key``,
``metrics_key``, ...) that a class has and that is left unset (or empty) is filled from
``<home>/keys.json`` when that file exists (``rollstream up`` makes it; schemas/keys.py says
which role's key goes where). A value set in the environment or by a flag wins. ``insecure``
(``ROLLSTREAM_INSECURE=true``) leaves them unset: each service then answers anyone and says so
in its log. A key file that group or others may open is refused (``KeyFileError``), never
used. ``read_home_keys(home)`` is the one reader of the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .keys import (
    KEY_FIELDS,
    KEY_FILE,
    MAX_FILE_BYTES,
    KeyFileError,
    KeyRing,
    check_private,
    is_unset,
    parse,
)
from .keys import fills as key_fills
from .topics import Topics

__all__ = ["NONE_FROM_ENV", "CommonSettings", "kafka_client_config", "read_home_keys"]


# The config of a settings class whose optional settings are unset from the environment with
# ``none`` (ROLLSTREAM_PROC_MAX_CLOCK_AHEAD_S=none). Not CommonSettings': there
# ROLLSTREAM_COMPRESSION=none is a value.
NONE_FROM_ENV = SettingsConfigDict(
    env_prefix="ROLLSTREAM_", extra="ignore", env_parse_none_str="none"
)


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
    metrics_key: SecretStr | None = None  # Bearer key of /metrics (probes open); unset: keys.json
    log_format: Literal["text", "json"] = "text"  # json: one object a line (ts, level, logger, ...)
    # experiments only: a service without keys answers anyone (and says so in its log)
    insecure: bool = False  # true: <home>/keys.json is not read; unset key settings stay unset

    @model_validator(mode="after")
    def _keys_from_home(self) -> Self:
        """Fill the unset key settings of this class from ``<home>/keys.json`` (module doc)."""
        if self.insecure:
            return self
        present = {
            name: getattr(self, name) for name in KEY_FIELDS if name in type(self).model_fields
        }
        if not any(is_unset(value) for value in present.values()):
            return self
        ring = read_home_keys(self.home)
        if ring is not None:
            for name, value in key_fills(ring, present).items():
                setattr(self, name, value)
        return self

    def topics(self) -> Topics:
        return Topics(self.namespace, replication=self.topic_replication)

    def kafka_config(self) -> dict[str, Any]:
        return kafka_client_config(self)


def read_home_keys(home: Path) -> KeyRing | None:
    """The keys of ``<home>/keys.json``; None when there is no such file. KeyFileError when it
    cannot be read, is open to group or others, or is no key file."""
    path = Path(home) / KEY_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO put there must not hang us
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot open the key file: {exc.strerror}") from exc
    try:
        check_private(os.fstat(fd).st_mode, path)  # of the file opened, not of a name
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    return parse(raw, path)


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
