"""Avro codec for rollstream records (fastavro).

Wire formats:
- Avro single-object encoding (default): ``C3 01`` + 8-byte little-endian CRC-64-AVRO
  fingerprint of the writer schema's canonical form + the Avro binary body. Readers resolve the
  writer schema by fingerprint and read it into the current (reader) schema, so records written
  by an older or newer compatible schema decode.
- Confluent Schema Registry framing (when the codec is given a ``SchemaRegistry``): ``00`` +
  4-byte big-endian schema id + body, the framing of Confluent's own serializers (their "magic
  byte 0" prefix), so a Confluent ``AvroDeserializer`` reads our records and we read theirs.
  The registry client is an I/O edge that lives in ``rollstream.adapters.registry`` (over
  confluent-kafka's ``SchemaRegistryClient``); this module knows only the ``SchemaRegistry``
  protocol. Subjects are named after the record, ``<record full name>-value``
  (``rollstream.Event-value``; ``registry_subject``), not after the topic as Confluent's default
  TopicNameStrategy does (``<topic>-value``): a codec encodes a record without knowing its topic,
  one record type is the unit of schema evolution, and namespaced topics (``ns.rollout.events``,
  replays beside live data) would otherwise register the same schema under one subject per
  namespace. Readers resolve a schema by id alone, so any Confluent client reads our topics
  whatever the subject.

Token arrays are packed bytes fields (see events.py), so a decode reads the record plus one
``np.frombuffer`` per array. ``Codec.encode`` writes records through a writer compiled from the
schema (fastwrite.py), falling back to fastavro for a schema the compiler does not support (the
same bytes). ``Codec.decode`` reads records written with the reader schema itself (the usual
case) through a reader compiled from that schema (fastread.py), straight into the typed classes;
a record written with another schema version, or with a schema the compiled reader does not
support, goes through fastavro's schema resolution and ``from_avro``. ``decode_dict`` always uses
fastavro. ``Codec.decode`` never raises anything but ``DecodeError``.
"""

from __future__ import annotations

import copy
import io
import json
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form

from .errors import DecodeError, EncodeError, RegistryError, UnknownSchemaError
from .events import (
    BODY_TYPES,
    Event,
    PolicyVersion,
    Record,
    RewardRecord,
    Sample,
    Trajectory,
    TrajectoryNode,
    Usage,
)
from .fastread import Reader, ReadError, compile_reader
from .fastwrite import Writer, compile_flat_writer, compile_writer

__all__ = [
    "AVRO_DIR",
    "RECORD_TYPES",
    "Codec",
    "SchemaRegistry",
    "SchemaSet",
    "load_schema",
    "previous_schemas",
    "registry_subject",
]

AVRO_DIR = Path(__file__).parent / "avro"
SINGLE_OBJECT_MAGIC = b"\xc3\x01"
CONFLUENT_MAGIC = b"\x00"
RECORD_TYPES: dict[str, type[Any]] = {
    "rollstream.Event": Event,
    "rollstream.PolicyVersion": PolicyVersion,
    "rollstream.Trajectory": Trajectory,
    "rollstream.Sample": Sample,
}
_MISS: Any = object()
_TYPE_NAMES = {cls: name for name, cls in RECORD_TYPES.items()}
_RECORD_CLASSES: dict[str, type[Any]] = {
    **RECORD_TYPES,
    **BODY_TYPES,
    **{cls.AVRO_NAME: cls for cls in (Usage, TrajectoryNode, RewardRecord)},
}


def _expand(schema: Any, avro_dir: Path, seen: set[str]) -> Any:
    """Inline named references (``"rollstream.Usage"``) from ``<name>.avsc`` files, defining each
    name once (Avro forbids redefinition) and referring to it by name afterwards."""
    if isinstance(schema, str):
        if "." in schema and schema not in seen:
            path = avro_dir / f"{schema}.avsc"
            if path.exists():
                return _expand(json.loads(path.read_text()), avro_dir, seen)
        return schema
    if isinstance(schema, list):
        return [_expand(s, avro_dir, seen) for s in schema]
    if isinstance(schema, dict):
        out = dict(schema)
        kind = out.get("type")
        if kind in ("record", "enum", "fixed"):
            name = (
                out["name"] if "." in out["name"] else f"{out.get('namespace', '')}.{out['name']}"
            )
            seen.add(name)
        if kind == "record":
            out["fields"] = [
                {**f, "type": _expand(f["type"], avro_dir, seen)} for f in out["fields"]
            ]
        elif kind == "array":
            out["items"] = _expand(out["items"], avro_dir, seen)
        elif kind == "map":
            out["values"] = _expand(out["values"], avro_dir, seen)
        elif isinstance(kind, dict | list):
            out["type"] = _expand(kind, avro_dir, seen)
        return out
    return schema


def load_schema(name: str, avro_dir: Path = AVRO_DIR) -> dict[str, Any]:
    """The full (self-contained) JSON schema of a top-level record, e.g. ``rollstream.Event``."""
    raw = json.loads((avro_dir / f"{name}.avsc").read_text())
    expanded: dict[str, Any] = _expand(raw, avro_dir, set())
    return expanded


def previous_schemas(avro_dir: Path = AVRO_DIR) -> list[dict[str, Any]]:
    """The earlier versions of the record schemas, kept self-contained (expanded) in
    ``<name>.v<N>.avsc`` files: a default ``SchemaSet`` knows them as writers, so records that an
    older release wrote (single-object encoding names the writer by fingerprint alone) still
    decode, read into the current schema. A schema change adds the version it replaces here."""
    found: list[dict[str, Any]] = [
        json.loads(path.read_text()) for path in sorted(avro_dir.glob("*.v[0-9]*.avsc"))
    ]
    return found


class _Schema:
    """One parsed schema with its fingerprint and full name."""

    __slots__ = ("canonical", "fingerprint", "json", "name", "parsed")

    def __init__(self, schema_json: dict[str, Any]) -> None:
        self.json = schema_json
        parsed: dict[str, Any] = fastavro.parse_schema(copy.deepcopy(schema_json), _force=True)  # type: ignore[assignment]
        self.parsed = parsed
        self.name: str = parsed["name"]
        self.canonical = to_parsing_canonical_form(self.parsed)
        self.fingerprint = bytes.fromhex(fingerprint(self.canonical, "CRC-64-AVRO"))


class SchemaSet:
    """Reader schemas (one per record type) and every writer schema we can resolve (by default
    also the earlier versions, ``previous_schemas``)."""

    def __init__(self, reader_schemas: list[dict[str, Any]] | None = None) -> None:
        previous: list[dict[str, Any]] = []
        if reader_schemas is None:
            reader_schemas = [load_schema(name) for name in RECORD_TYPES]
            previous = previous_schemas()
        self._lock = threading.Lock()
        self.readers: dict[str, _Schema] = {}
        self.writers: dict[bytes, _Schema] = {}
        for schema_json in previous:
            old = _Schema(schema_json)
            self.writers[old.fingerprint] = old
        for schema_json in reader_schemas:
            schema = _Schema(schema_json)
            self.readers[schema.name] = schema
            self.writers[schema.fingerprint] = schema

    def add_writer(self, schema_json: dict[str, Any]) -> bytes:
        """Register an older or newer writer schema; returns its fingerprint."""
        schema = _Schema(schema_json)
        with self._lock:
            self.writers[schema.fingerprint] = schema
        return schema.fingerprint

    def reader(self, name: str) -> _Schema:
        return self.readers[name]


class SchemaRegistry(Protocol):
    """What the codec needs of a Confluent-compatible schema registry.
    ``rollstream.adapters.registry.ConfluentRegistry`` implements it over confluent-kafka's
    client; both calls raise ``RegistryError`` when the registry fails or answers nonsense."""

    def register(self, subject: str, schema_json: dict[str, Any]) -> int:
        """The id of ``schema_json`` under ``subject`` (registering it when it is new)."""
        ...

    def get(self, schema_id: int) -> dict[str, Any]:
        """The Avro schema (parsed JSON) registered with id ``schema_id``."""
        ...


def registry_subject(name: str) -> str:
    """The registry subject of record type ``name``: ``rollstream.Event`` ->
    ``rollstream.Event-value`` (why not the topic: see the module docstring)."""
    return f"{name}-value"


class Codec:
    """Encodes and decodes rollstream records.

    ``encode(record)`` picks the schema from the record's type. ``decode(data)`` returns the
    typed record; ``decode(data, expect=Sample)`` also checks the type. Any failure to decode is
    a ``DecodeError`` carrying the raw bytes and the reason.

    With a ``registry`` the codec frames records for it: the first record of a type registers
    that type's schema (``RegistryError`` if the registry fails; the id is kept, so later
    records of the type never wait on the registry) and a record of an unknown id fetches its
    writer schema once.
    """

    def __init__(
        self,
        schemas: SchemaSet | None = None,
        *,
        registry: SchemaRegistry | None = None,
        writer_overrides: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        self.schemas = schemas or SchemaSet()
        self.registry = registry
        self._registry_ids: dict[str, int] = {}
        self._registry_writers: dict[int, _Schema] = {}
        # a writer schema other than the reader (used to produce old/new versions in tests)
        self._writers: dict[str, _Schema] = {}
        # writes the header, then the body; None: a schema the compiler does not support
        self._compiled: dict[str, Writer | None] = {}
        # header bytes (C3 01 + fingerprint, or 00 + registry id) -> compiled reader, for the
        # writer schemas that are their reader schema; None: use fastavro's resolution
        self._fast: dict[bytes, tuple[int, str, type[Any], Reader] | None] = {}
        self._readers: dict[str, Reader | None] = {}  # by record name
        for name, schema_json in (writer_overrides or {}).items():
            fp = self.schemas.add_writer(schema_json)
            self._writers[name] = self.schemas.writers[fp]

    # --- encode ---------------------------------------------------------------------------

    def _writer(self, name: str) -> _Schema:
        return self._writers.get(name) or self.schemas.reader(name)

    def _header(self, name: str) -> bytes:
        """The wire header of records of type ``name``: ``C3 01`` + fingerprint, or ``00`` +
        registry id (registering the writer schema the first time; ``RegistryError``)."""
        schema = self._writer(name)
        if self.registry is None:
            return SINGLE_OBJECT_MAGIC + schema.fingerprint
        schema_id = self._registry_ids.get(name)
        if schema_id is None:
            schema_id = self.registry.register(registry_subject(name), schema.json)
            self._registry_ids[name] = schema_id
        return CONFLUENT_MAGIC + struct.pack(">I", schema_id)

    def _compile(self, name: str) -> Writer | None:
        """The compiled writer of ``name`` (kept), or None: fastavro writes it (another writer
        schema version, or a schema construct the compiled writer does not support)."""
        write: Writer | None = None
        if name not in self._writers:
            header = self._header(name)
            try:
                write = compile_writer(
                    self.schemas.reader(name).json, _RECORD_CLASSES, prefix=header
                )
            except Exception:  # a schema or class the compiled writer cannot handle
                write = None
        self._compiled[name] = write
        return write

    def encode(self, record: Record) -> bytes:
        name = _TYPE_NAMES.get(type(record))
        if name is None:
            raise EncodeError(f"not a top-level rollstream record: {type(record).__name__}")
        write = self._compiled.get(name, _MISS)
        if write is _MISS:
            write = self._compile(name)
        if write is None:
            return self.encode_dict(name, record.to_avro())
        try:
            return write(record)
        except Exception as exc:  # a value that does not fit its field
            raise EncodeError(f"{name}: {type(exc).__name__}: {exc}") from exc

    def flat_writer(
        self, name: str, body: str, params: tuple[str, ...]
    ) -> Callable[..., bytes] | None:
        """A writer of record ``name`` with a ``body`` event from its leaf fields as
        positional arguments (``fastwrite.compile_flat_writer``): the same bytes ``encode``
        makes, registry framing included, with no record objects built. None when this codec
        writes ``name`` with another schema version: the caller encodes records. With a
        registry, the schema of ``name`` is registered here (``RegistryError``)."""
        if name in self._writers:
            return None
        return compile_flat_writer(
            self.schemas.reader(name).json,
            _RECORD_CLASSES,
            body=body,
            params=params,
            prefix=self._header(name),
        )

    def encode_dict(self, name: str, data: dict[str, Any]) -> bytes:
        schema = self._writer(name)
        buf = io.BytesIO()
        buf.write(self._header(name))
        try:
            fastavro.schemaless_writer(buf, schema.parsed, data)
        except Exception as exc:
            raise EncodeError(f"{name}: {exc}") from exc
        return buf.getvalue()

    # --- decode ---------------------------------------------------------------------------

    def _resolve(self, data: bytes) -> tuple[_Schema, int]:
        if data[:2] == SINGLE_OBJECT_MAGIC and len(data) >= 10:
            writer = self.schemas.writers.get(data[2:10])
            if writer is None:
                raise UnknownSchemaError(f"unknown schema fingerprint {data[2:10].hex()}", data)
            return writer, 10
        if data[:1] == CONFLUENT_MAGIC and len(data) >= 5:
            if self.registry is None:
                raise UnknownSchemaError("registry-framed record but no registry configured", data)
            (schema_id,) = struct.unpack(">I", data[1:5])
            writer = self._registry_writers.get(schema_id)
            if writer is None:
                try:
                    writer = _Schema(self.registry.get(schema_id))
                except RegistryError as exc:
                    raise UnknownSchemaError(str(exc), data) from exc
                except Exception as exc:  # an answer that is no Avro record schema
                    raise UnknownSchemaError(f"schema id {schema_id}: {exc}", data) from exc
                self._registry_writers[schema_id] = writer
            return writer, 5
        raise DecodeError("no Avro single-object or registry header", data)

    def decode_dict(self, data: bytes) -> tuple[str, dict[str, Any]]:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise DecodeError(f"expected bytes, got {type(data).__name__}", b"")
        data = bytes(data)
        writer, offset = self._resolve(data)
        reader = self.schemas.readers.get(writer.name)
        if reader is None:
            raise UnknownSchemaError(f"no reader schema for {writer.name}", data)
        buf = io.BytesIO(data)
        buf.seek(offset)
        try:
            record = fastavro.schemaless_reader(
                buf,
                writer.parsed,
                reader.parsed if reader is not writer else None,
                return_record_name=True,
            )
        except Exception as exc:
            raise DecodeError(f"{writer.name}: {type(exc).__name__}: {exc}", data) from exc
        if buf.tell() != len(data):
            raise DecodeError(f"{len(data) - buf.tell()} trailing bytes after {writer.name}", data)
        return writer.name, record  # type: ignore[return-value]

    def _fast_reader(self, data: bytes) -> tuple[int, str, type[Any], Reader] | None:
        """The compiled reader for the header of ``data`` when its writer schema is the reader
        schema (same canonical form); None otherwise. Raises what ``_resolve`` raises."""
        writer, offset = self._resolve(data)
        reader = self.schemas.readers.get(writer.name)
        entry = None
        if reader is not None and reader.fingerprint == writer.fingerprint:
            if writer.name not in self._readers:
                try:
                    self._readers[writer.name] = compile_reader(reader.json, _RECORD_CLASSES)
                except Exception:  # a schema or class the compiled reader cannot handle
                    self._readers[writer.name] = None
            read = self._readers[writer.name]
            if read is not None:
                entry = (offset, writer.name, RECORD_TYPES[writer.name], read)
        self._fast[data[:offset]] = entry
        return entry

    def decode(self, data: bytes, expect: type[Any] | None = None) -> Any:
        if type(data) is not bytes:
            if not isinstance(data, bytearray | memoryview):
                raise DecodeError(f"expected bytes, got {type(data).__name__}", b"")
            data = bytes(data)
        fast = self._fast.get(data[:10], _MISS)
        if fast is _MISS and data[:1] == CONFLUENT_MAGIC:
            fast = self._fast.get(data[:5], _MISS)
        if fast is _MISS:
            fast = self._fast_reader(data)
        if fast is not None:
            offset, name, cls, read = fast
            try:
                record, end = read(data, offset)
            except ReadError as exc:
                raise DecodeError(f"{name}: {exc}", data) from exc
            if end != len(data):
                raise DecodeError(f"{len(data) - end} trailing bytes after {name}", data)
            if expect is not None and cls is not expect:
                raise DecodeError(f"expected {expect.__name__}, got {cls.__name__}", data)
            return record
        name, record = self.decode_dict(data)
        cls = RECORD_TYPES[name]
        if expect is not None and cls is not expect:
            raise DecodeError(f"expected {expect.__name__}, got {cls.__name__}", bytes(data))
        try:
            return cls.from_avro(record)
        except Exception as exc:
            raise DecodeError(f"{name}: {type(exc).__name__}: {exc}", bytes(data)) from exc
