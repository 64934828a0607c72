"""Errors of the event contract.

SchemaError                      root of rollstream.schemas
├── DecodeError                  bytes that are not a record we can read (carries raw + reason)
│   └── UnknownSchemaError       a fingerprint / registry id no known schema matches (or the
│                                registry could not tell: the RegistryError is its cause)
├── EncodeError                  a record that does not fit its schema
└── RegistryError                the schema registry failed or answered nonsense (raised by a
                                 SchemaRegistry, e.g. rollstream.adapters.registry, from the
                                 client's own error)
"""

from __future__ import annotations

__all__ = ["DecodeError", "EncodeError", "RegistryError", "SchemaError", "UnknownSchemaError"]


class SchemaError(Exception):
    """Root of every error raised by rollstream.schemas."""


class DecodeError(SchemaError):
    """Raw bytes could not be decoded. ``raw`` holds them, ``reason`` says why, so the caller
    can route the record to the dead-letter topic unchanged."""

    def __init__(self, reason: str, raw: bytes) -> None:
        super().__init__(f"cannot decode record ({len(raw)} bytes): {reason}")
        self.reason = reason
        self.raw = raw


class UnknownSchemaError(DecodeError):
    """The record names a writer schema (fingerprint or registry id) that we do not know."""


class EncodeError(SchemaError):
    """A record does not fit its schema."""


class RegistryError(SchemaError):
    """The Confluent-compatible schema registry failed: ``Codec.encode`` raises it when the
    first record of a type cannot be registered; on decode it becomes an
    ``UnknownSchemaError``."""
