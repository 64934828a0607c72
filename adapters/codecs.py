"""The Codec every deployable builds from its settings: Avro single-object encoding by default,
Confluent Schema Registry framing when ``ROLLSTREAM_SCHEMA_REGISTRY_URL`` is set."""

from __future__ import annotations

from rollstream.schemas import Codec, CommonSettings, RegistryClient

__all__ = ["build_codec"]


def build_codec(settings: CommonSettings) -> Codec:
    """A Codec for ``settings``: registry framing when ``schema_registry_url`` is set."""
    if not settings.schema_registry_url:
        return Codec()
    return Codec(registry=RegistryClient(settings.schema_registry_url))
