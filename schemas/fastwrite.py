"""A compiled Avro binary writer for rollstream's typed records.

fastavro writes dicts: encoding a record first builds a dict of it (``to_avro``) and then walks
the schema for every record. The SDK encodes every event on the harness's thread, so the codec
compiles, once per (schema, class), a flat plan of small encoder closures that read the
dataclass attributes directly and append Avro binary to one bytearray. The output is byte for
byte what fastavro writes (a test checks it on generated records of every type).

Supported: the types rollstream's schemas use — null, boolean, int, long, double, string,
bytes (from numpy arrays or bytes), enum, record, array, map, and unions of those.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from enum import Enum
from typing import Any

import numpy as np

__all__ = ["Writer", "compile_writer"]

Encoder = Callable[[bytearray, Any], None]
Writer = Callable[[Any], bytes]

_pack_double = struct.Struct("<d").pack
_pack_float = struct.Struct("<f").pack


def _zigzag(buf: bytearray, n: int) -> None:
    n = (n << 1) ^ (n >> 63)
    while n & ~0x7F:
        buf.append((n & 0x7F) | 0x80)
        n >>= 7
    buf.append(n)


def _varint(n: int) -> bytes:
    out = bytearray()
    _zigzag(out, n)
    return bytes(out)


_SMALL = 1 << 14  # lengths, counts, seqs, versions: one lookup instead of a loop
_SMALL_LONGS = [_varint(n) for n in range(_SMALL)]


def _long(buf: bytearray, n: int) -> None:
    if 0 <= n < _SMALL:
        buf += _SMALL_LONGS[n]
    else:
        _zigzag(buf, n)


def _string(buf: bytearray, s: str) -> None:
    data = s.encode()
    _long(buf, len(data))
    buf += data


def _bytes(buf: bytearray, v: Any) -> None:
    data = v.tobytes() if isinstance(v, np.ndarray) else bytes(v)
    _long(buf, len(data))
    buf += data


def _double(buf: bytearray, v: float) -> None:
    buf += _pack_double(v)


def _float(buf: bytearray, v: float) -> None:
    buf += _pack_float(v)


def _boolean(buf: bytearray, v: bool) -> None:
    buf.append(1 if v else 0)


def _null(buf: bytearray, v: Any) -> None:
    return None


_PRIMITIVES: dict[str, Encoder] = {
    "null": _null,
    "boolean": _boolean,
    "int": _long,
    "long": _long,
    "double": _double,
    "float": _float,
    "string": _string,
    "bytes": _bytes,
}


def _name(schema: dict[str, Any]) -> str:
    name: str = schema["name"]
    return name if "." in name else f"{schema.get('namespace', '')}.{name}".lstrip(".")


class _Compiler:
    """Turns a (self-contained) schema into encoders; records map to classes by full name."""

    def __init__(self, classes: dict[str, type]) -> None:
        self.classes = classes
        self.named: dict[str, Encoder] = {}

    def compile(self, schema: Any, namespace: str = "") -> Encoder:
        if isinstance(schema, str):
            if schema in _PRIMITIVES:
                return _PRIMITIVES[schema]
            full = schema if "." in schema else f"{namespace}.{schema}"
            return lambda buf, v, _f=full: self.named[_f](buf, v)
        if isinstance(schema, list):
            return self._union(schema, namespace)
        kind = schema["type"]
        if kind in _PRIMITIVES:
            return _PRIMITIVES[kind]
        if kind == "record":
            return self._record(schema)
        if kind == "enum":
            index = {s: i for i, s in enumerate(schema["symbols"])}

            def enc_enum(buf: bytearray, v: Any, _i: dict[str, int] = index) -> None:
                _long(buf, _i[v.value if isinstance(v, Enum) else v])

            self.named[_name(schema)] = enc_enum
            return enc_enum
        if kind == "array":
            item = self.compile(schema["items"], namespace)

            def enc_array(buf: bytearray, v: Any) -> None:
                if len(v):
                    _long(buf, len(v))
                    for x in v:
                        item(buf, x)
                buf.append(0)

            return enc_array
        if kind == "map":
            value = self.compile(schema["values"], namespace)

            def enc_map(buf: bytearray, v: dict[str, Any]) -> None:
                if v:
                    _long(buf, len(v))
                    for k, x in v.items():
                        _string(buf, k)
                        value(buf, x)
                buf.append(0)

            return enc_map
        if isinstance(kind, dict | list | str):
            return self.compile(kind, namespace)
        raise TypeError(f"unsupported schema: {schema!r}")

    def _union(self, branches: list[Any], namespace: str) -> Encoder:
        encs = [self.compile(b, namespace) for b in branches]
        names = [b if isinstance(b, str) else b.get("type") for b in branches]
        if len(branches) == 2 and "null" in names:
            null_at = names.index("null")
            other, other_enc = 1 - null_at, encs[1 - null_at]

            def enc_nullable(buf: bytearray, v: Any) -> None:
                if v is None:
                    buf.append(null_at * 2)
                else:
                    buf.append(other * 2)
                    other_enc(buf, v)

            return enc_nullable
        by_class: dict[type, tuple[int, Encoder]] = {}
        for i, b in enumerate(branches):
            full = (
                b
                if isinstance(b, str)
                else _name(b)
                if isinstance(b, dict) and "name" in b
                else None
            )
            if full is not None and "." not in full and full not in _PRIMITIVES:
                full = f"{namespace}.{full}"
            cls = self.classes.get(full) if full else None
            if cls is None:
                raise TypeError(f"union branch {b!r} has no record class")
            by_class[cls] = (i, encs[i])

        def enc_union(buf: bytearray, v: Any) -> None:
            i, enc = by_class[type(v)]
            _long(buf, i)
            enc(buf, v)

        return enc_union

    def _record(self, schema: dict[str, Any]) -> Encoder:
        full = _name(schema)
        ns = full.rpartition(".")[0]
        fields: list[tuple[str, Encoder]] = []

        def enc_record(buf: bytearray, v: Any) -> None:
            for attr, enc in fields:
                enc(buf, getattr(v, attr))

        self.named[full] = enc_record  # before the fields: recursive references resolve
        fields.extend((f["name"], self.compile(f["type"], ns)) for f in schema["fields"])
        return enc_record


def compile_writer(schema: dict[str, Any], classes: dict[str, type]) -> Writer:
    """A function ``record -> Avro binary body`` for ``schema``, reading the attributes of the
    typed records whose classes are given by full Avro name."""
    encode = _Compiler(classes).compile(schema)

    def write(record: Any) -> bytes:
        buf = bytearray()
        encode(buf, record)
        return bytes(buf)

    return write
