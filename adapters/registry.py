"""The codec's schema registry: confluent-kafka's ``SchemaRegistryClient`` behind the
``rollstream.schemas.SchemaRegistry`` protocol.

Any registry with a Confluent-compatible REST API works (Confluent Schema Registry, Karapace,
Apicurio Registry's ``/apis/ccompat/v7``). The client comes with the ``registry`` extra
(``pip install 'rollstream[registry]'``, i.e. ``confluent-kafka[schemaregistry]``) and is
imported only when a registry is configured, so the base SDK install works without it.
confluent-kafka's client caches ids and schemas and retries transport failures; whatever it
still raises becomes a ``rollstream.schemas.RegistryError`` (``from`` the client's error).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rollstream.schemas import RegistryError

__all__ = ["ConfluentRegistry"]


class ConfluentRegistry:
    """A ``SchemaRegistry`` over confluent-kafka's client. ``url``: the registry's base URL
    (``http://host:8081``; credentials as ``http://user:password@host``); ``conf``: more
    ``SchemaRegistryClient`` settings (``basic.auth.user.info``, ``ssl.ca.location``,
    ``timeout``, ``max.retries``, ...)."""

    def __init__(self, url: str, conf: Mapping[str, Any] | None = None) -> None:
        try:
            from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
        except ImportError as exc:  # the base install: the registry extra is missing
            raise RegistryError(
                f"a schema registry is configured ({url}) but confluent-kafka's registry "
                "client is not installed: pip install 'rollstream[registry]'"
            ) from exc
        self.url = url
        self._schema = Schema
        try:
            self._client = SchemaRegistryClient({**(conf or {}), "url": url})
        except Exception as exc:  # a malformed URL or setting
            raise RegistryError(f"schema registry client for {url}: {exc}") from exc

    def register(self, subject: str, schema_json: dict[str, Any]) -> int:
        text = json.dumps(schema_json, separators=(",", ":"))
        try:
            return int(self._client.register_schema(subject, self._schema(text, "AVRO")))
        except Exception as exc:
            raise RegistryError(f"registering {subject} at {self.url}: {exc}") from exc

    def get(self, schema_id: int) -> dict[str, Any]:
        try:
            schema = self._client.get_schema(schema_id)
        except Exception as exc:
            raise RegistryError(f"fetching schema id {schema_id} from {self.url}: {exc}") from exc
        if schema.schema_type not in (None, "AVRO"):
            raise RegistryError(f"schema id {schema_id} is {schema.schema_type}, not Avro")
        try:
            parsed = json.loads(schema.schema_str or "")
        except ValueError as exc:
            raise RegistryError(f"schema id {schema_id} is not JSON: {exc}") from exc
        if not isinstance(parsed, dict):
            raise RegistryError(f"schema id {schema_id} is not an Avro record schema")
        return parsed

    def close(self) -> None:
        """Close the client's HTTP connections."""
        self._client.close()
