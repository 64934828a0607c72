"""Every error rollstream.infra raises, under one root.

InfraError                  root of rollstream.infra
├── KafkaError              (kafka.py) the local broker
│   ├── ClasspathError      Maven could not resolve the broker's jars
│   └── BrokerStartError    the broker exited or did not answer metadata in time
├── ServiceError            (services.py) a supervised service exited or did not become
│                           ready
└── MissingExtra            (flags.py) a command needs a module that only one of
                            rollstream's extras installs (the CLI exits 2 naming it)
"""

from __future__ import annotations

__all__ = ["BrokerStartError", "ClasspathError", "InfraError", "KafkaError", "ServiceError"]


class InfraError(Exception):
    """Root of every error raised by rollstream.infra."""


class KafkaError(InfraError):
    """Root of rollstream.infra.kafka errors."""


class ClasspathError(KafkaError):
    """Maven could not resolve the broker's jars."""


class BrokerStartError(KafkaError):
    """The broker exited or did not answer metadata in time."""


class ServiceError(InfraError):
    """A service exited or did not become ready."""
