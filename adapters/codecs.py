"""The Codec every deployable builds from its settings: Avro single-object encoding by default,
Confluent Schema Registry framing when ``ROLLSTREAM_SCHEMA_REGISTRY_URL`` is set (through
confluent-kafka's registry client, ``rollstream.adapters.registry``)."""

from __future__ import annotations

from rollstream.schemas import Codec, CommonSettings

from .registry import ConfluentRegistry

__all__ = ["build_codec"]


def build_codec(settings: CommonSettings) -> Codec:
    """A Codec for ``settings``: registry framing when ``schema_registry_url`` is set. No I/O
    here: a record type's schema is registered when the codec first writes one (``RegistryError``
    if the registry fails then), and schemas are fetched by id when records are read."""
    if not settings.schema_registry_url:
        return Codec()
    return Codec(registry=ConfluentRegistry(settings.schema_registry_url))
