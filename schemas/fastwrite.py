"""A compiled Avro binary writer for rollstream's typed records (the mirror of fastread.py).

fastavro writes dicts: encoding a record first builds a dict of it (``to_avro``) and then walks
the schema for every record. The SDK encodes every event on the harness's thread, so the codec
compiles, once per schema, a writer: each named record becomes one generated Python function
whose body is the record's fields as straight-line write steps (attribute read, varint from a
table of small values), each appending its piece to one list that starts with the wire header;
the output is one ``bytes.join`` of the list. Packed arrays go in as views of their numpy
buffer when they are C-contiguous (no ``tobytes`` copy), so each byte of a record is copied
once, into the output (a growing bytearray copied large arrays up to three times, and
reallocated itself several times per record even without them). The output is byte for byte
what fastavro writes (a test checks it on generated records of every type).

``compile_flat_writer`` makes a writer of one envelope + body pair (the SDK's LlmCall event)
from the leaf fields as positional arguments: no record objects are built and no attributes
read, which is about a third of an event's encoding on the harness's thread (the same bytes:
a test compares them with ``compile_writer``'s).

Supported: the types rollstream's schemas use — null, boolean, int, long, float, double, string,
bytes (from numpy arrays or bytes), enum, record, array, map, and unions of those. A value of
the wrong type raises (TypeError, AttributeError, KeyError, ...): the codec wraps it.
"""

from __future__ import annotations

import keyword
import struct
from collections.abc import Callable
from enum import Enum
from typing import Any

import numpy as np

from .codegen import CodeGen, full_name

__all__ = ["Writer", "compile_flat_writer", "compile_writer"]

Writer = Callable[[Any], bytes]

_PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "string", "bytes"})


_SMALL = 1 << 14  # lengths, counts, seqs, versions: one lookup instead of a loop
# varint bytes of 0 <= n < _SMALL; 14 bits of a longer varint (continuation bits set); and the
# zig-zag varint of 0 <= n < _SMALL (what a small long is written as)
_RAW = tuple(bytes((n,)) if n < 0x80 else bytes(((n & 0x7F) | 0x80, n >> 7)) for n in range(_SMALL))
_GROUP = tuple(bytes(((k & 0x7F) | 0x80, (k >> 7) | 0x80)) for k in range(_SMALL))
_SMALL_LONGS = tuple(
    _RAW[m] if m < _SMALL else _GROUP[m & 0x3FFF] + _RAW[m >> 14] for m in range(0, 2 * _SMALL, 2)
)


def _varint(n: int) -> bytes:
    """Zig-zag varint of any long, 14 bits per table lookup (a timestamp in us: 4 lookups)."""
    n = (n << 1) ^ (n >> 63)
    out = b""
    while n >= _SMALL:
        out += _GROUP[n & 0x3FFF]
        n >>= 14
    return out + _RAW[n]


_BYTE = tuple(bytes((n,)) for n in range(256))  # one-byte pieces: booleans, union indexes


class _Compiler(CodeGen):
    """Generates the source of one function ``(put, v)`` per named record and execs it once;
    ``put`` appends a piece (bytes, or a view of an array's buffer) to the output's list."""

    def __init__(self, classes: dict[str, type]) -> None:
        env: dict[str, Any] = {
            "_L": _SMALL_LONGS,
            "_S": _SMALL,
            "_V": _varint,
            "_pack_d": struct.Struct("<d").pack,
            "_pack_f": struct.Struct("<f").pack,
            "_ndarray": np.ndarray,
            "_memoryview": memoryview,
            "_Enum": Enum,
            "_B": _BYTE,
            "_cat": b"".join,
        }
        super().__init__(classes, env)
        self.enums: dict[str, str] = {}  # full name -> name of its symbol -> index dict
        self.record_schemas: dict[str, dict[str, Any]] = {}  # full name -> its definition
        self.unions: list[dict[type, Any]] = []  # class -> (tag, function name until exec)

    def _define(self, schema: Any, namespace: str) -> None:
        """Register the named types defined inline in ``schema`` (records compile on sight)."""
        if not isinstance(schema, dict):
            return
        kind = schema.get("type")
        if kind == "record":
            self._record(schema, namespace)
        elif kind == "enum":
            full = full_name(schema["name"], schema.get("namespace", namespace))
            index = {s: i for i, s in enumerate(schema["symbols"])}
            self.enums[full] = self._const(index, "enum")

    # --- emitting -------------------------------------------------------------------------

    @staticmethod
    def _long(out: list[str], ind: str, x: str, non_negative: bool = False) -> None:
        test = f"{x} < _S" if non_negative else f"0 <= {x} < _S"
        out.append(f"{ind}put(_L[{x}] if {test} else _V({x}))")

    def _emit(self, schema: Any, namespace: str, out: list[str], ind: str, x: str) -> None:
        """Lines that append the encoding of the value in variable ``x`` (with ``put``)."""
        self._define(schema, namespace)
        if isinstance(schema, list):
            self._union(schema, namespace, out, ind, x)
            return
        if isinstance(schema, dict):
            kind = schema["type"]
            if kind in ("record", "enum"):
                full = full_name(schema["name"], schema.get("namespace", namespace))
                self._named(full, out, ind, x)
            elif kind == "array":
                self._array(schema["items"], namespace, out, ind, x)
            elif kind == "map":
                self._map(schema["values"], namespace, out, ind, x)
            elif kind in _PRIMITIVES or isinstance(kind, dict | list):
                self._emit(kind, namespace, out, ind, x)
            elif isinstance(kind, str):  # {"type": "rollstream.Usage"}
                self._named(full_name(kind, namespace), out, ind, x)
            else:
                raise TypeError(f"unsupported schema: {schema!r}")
            return
        if not isinstance(schema, str):
            raise TypeError(f"unsupported schema: {schema!r}")
        if schema not in _PRIMITIVES:
            self._named(full_name(schema, namespace), out, ind, x)
        elif schema == "null":
            pass
        elif schema == "boolean":
            out.append(f"{ind}put(_B[1] if {x} else _B[0])")
        elif schema in ("int", "long"):
            self._long(out, ind, x)
        elif schema == "double":
            out.append(f"{ind}put(_pack_d({x}))")
        elif schema == "float":
            out.append(f"{ind}put(_pack_f({x}))")
        elif schema == "string":
            d, n = self._var("d"), self._var("n")
            out += [f"{ind}{d} = {x}.encode()", f"{ind}{n} = len({d})"]
            self._long(out, ind, n, non_negative=True)
            out.append(f"{ind}put({d})")
        else:  # bytes: a C-contiguous array goes in as a view of its buffer, anything else copied
            d, n = self._var("d"), self._var("n")
            out += [
                f"{ind}if isinstance({x}, _ndarray):",
                f"{ind}    {d} = _memoryview({x})",
                f"{ind}    if {d}.c_contiguous:",
                f"{ind}        {n} = {d}.nbytes",
                f"{ind}    else:",
                f"{ind}        {d} = {x}.tobytes()",
                f"{ind}        {n} = len({d})",
                f"{ind}else:",
                f"{ind}    {d} = bytes({x})",
                f"{ind}    {n} = len({d})",
            ]
            self._long(out, ind, n, non_negative=True)
            out.append(f"{ind}put({d})")

    def _named(self, full: str, out: list[str], ind: str, x: str) -> None:
        if full in self.records:
            out.append(f"{ind}{self.records[full]}(put, {x})")
        elif full in self.enums:
            out.append(
                f"{ind}put(_L[{self.enums[full]}[{x}.value if isinstance({x}, _Enum) else {x}]])"
            )
        else:
            raise TypeError(f"unknown named type {full!r}")

    def _union(self, branches: list[Any], namespace: str, out: list[str], ind: str, x: str) -> None:
        names = [b if isinstance(b, str) else b.get("type") for b in branches]
        if len(branches) == 2 and "null" in names:
            null_at = names.index("null")
            other = 1 - null_at
            out += [
                f"{ind}if {x} is None:",
                f"{ind}    put(_B[{null_at * 2}])",
                f"{ind}else:",
                f"{ind}    put(_B[{other * 2}])",
            ]
            self._emit(branches[other], namespace, out, ind + "    ", x)
            return
        # a union of records: the branch is the record's class
        by_class: dict[type, Any] = {}
        for i, b in enumerate(branches):
            self._define(b, namespace)
            if isinstance(b, str):
                full: str | None = b if b in _PRIMITIVES else full_name(b, namespace)
            elif isinstance(b, dict) and "name" in b:
                full = full_name(b["name"], b.get("namespace", namespace))
            else:
                full = None
            cls = self.classes.get(full) if full else None
            if cls is None or full not in self.records:
                raise TypeError(f"union branch {b!r} has no record class")
            by_class[cls] = (_SMALL_LONGS[i], self.records[full])
        table = self._const(by_class, "union")
        self.unions.append(by_class)
        tag, write = self._var("tag"), self._var("write")
        out += [
            f"{ind}{tag}, {write} = {table}[type({x})]",
            f"{ind}put({tag})",
            f"{ind}{write}(put, {x})",
        ]

    def _array(self, items: Any, namespace: str, out: list[str], ind: str, x: str) -> None:
        n, y = self._var("n"), self._var("y")
        out += [f"{ind}{n} = len({x})", f"{ind}if {n}:"]
        self._long(out, ind + "    ", n, non_negative=True)
        out.append(f"{ind}    for {y} in {x}:")
        self._emit(items, namespace, out, ind + "        ", y)
        out.append(f"{ind}put(_B[0])")

    def _map(self, values: Any, namespace: str, out: list[str], ind: str, x: str) -> None:
        n, k, y = self._var("n"), self._var("k"), self._var("y")
        out += [f"{ind}{n} = len({x})", f"{ind}if {n}:"]
        self._long(out, ind + "    ", n, non_negative=True)
        out.append(f"{ind}    for {k}, {y} in {x}.items():")
        self._emit("string", namespace, out, ind + "        ", k)
        self._emit(values, namespace, out, ind + "        ", y)
        out.append(f"{ind}put(_B[0])")

    def _record(self, schema: dict[str, Any], namespace: str) -> str:
        full = full_name(schema["name"], schema.get("namespace", namespace))
        if full in self.records:
            return self.records[full]
        self.record_schemas[full] = schema
        func = f"_w_{full.replace('.', '_')}_{len(self.records)}"
        self.records[full] = func  # before the fields: recursive references resolve
        ns = full.rpartition(".")[0]
        body: list[str] = []
        for f in schema["fields"]:
            name = f["name"]
            x = self._var("x")
            read = f"getattr(v, {name!r})" if keyword.iskeyword(name) else f"v.{name}"
            body.append(f"    {x} = {read}")
            self._emit(f["type"], ns, body, "    ", x)
        self.sources.append(f"def {func}(put, v):\n" + "\n".join(body or ["    pass"]))
        return func

    # --- flat writers ------------------------------------------------------------------------

    def _flat(
        self,
        full: str,
        out: list[str],
        path: str,
        body: str,
        leaves: list[str],
    ) -> None:
        """Lines writing record ``full`` from one variable per leaf field: a nested record's
        fields are named ``<field>_<subfield>``, and a union of records is written as its
        ``body`` branch, whose fields keep their own names."""
        schema = self.record_schemas[full]
        ns = full.rpartition(".")[0]
        for f in schema["fields"]:
            ftype = f["type"]
            name = f"{path}{f['name']}"
            if isinstance(ftype, list) and any(self._record_name(b, ns) for b in ftype):
                names = [self._record_name(b, ns) for b in ftype]
                if body not in names:
                    raise TypeError(f"flat writer: {full}.{f['name']} has no branch {body!r}")
                out.append(f"    put({self._const(_SMALL_LONGS[names.index(body)], 'tag')})")
                self._flat(body, out, path, body, leaves)
                continue
            nested = self._record_name(ftype, ns)
            if nested is not None:
                self._flat(nested, out, f"{name}_", body, leaves)
                continue
            if name in leaves or keyword.iskeyword(name):
                raise TypeError(f"flat writer: field name {name!r} is taken or reserved")
            leaves.append(name)
            self._emit(ftype, ns, out, "    ", name)

    def _record_name(self, schema: Any, namespace: str) -> str | None:
        """The full name of the record ``schema`` is or names; None for anything else."""
        if isinstance(schema, dict):
            if schema.get("type") == "record":
                return full_name(schema["name"], schema.get("namespace", namespace))
            return self._record_name(schema.get("type"), namespace)
        if isinstance(schema, str) and schema not in _PRIMITIVES:
            full = full_name(schema, namespace)
            return full if full in self.record_schemas else None
        return None

    def _function(self, params: str, lines: list[str], prefix: bytes, label: str) -> Any:
        """Exec the record functions and ``write(<params>)``, whose ``lines`` put the output's
        pieces after ``prefix``; returns ``write`` (its source on ``.source``, for debugging)."""
        self.env["_prefix"] = bytes(prefix)
        source = "\n\n".join(
            [
                *self.sources,
                f"def write({params}):\n    out = [_prefix]\n    put = out.append\n"
                + "\n".join(lines)
                + "\n    return _cat(out)",
            ]
        )
        exec(compile(source, f"<fastwrite {label}>", "exec"), self.env)
        for by_class in self.unions:  # the tables named record functions: now they exist
            for cls, (tag, func) in list(by_class.items()):
                by_class[cls] = (tag, self.env[func])
        write = self.env["write"]
        write.source = source
        return write


def compile_flat_writer(
    schema: dict[str, Any],
    classes: dict[str, type],
    *,
    body: str,
    params: tuple[str, ...],
    prefix: bytes = b"",
) -> Callable[..., bytes]:
    """A function taking the leaf fields of ``schema`` as positional arguments, in the order
    ``params`` names them, and returning the same bytes ``compile_writer`` makes of the
    record they describe, for records whose union of records holds a ``body`` record (the
    envelope and one event type). Nested records' fields are named ``<field>_<subfield>``.
    It builds no record objects and reads no attributes: the SDK's hot path (an LlmCall per
    model call) is written this way. ``params`` must name every leaf exactly once (checked
    here, so a field added to the schema fails loudly where the writer is made)."""
    compiler = _Compiler(classes)
    compiler._define(schema, "")
    top = full_name(schema["name"], schema.get("namespace", ""))
    lines: list[str] = []
    leaves: list[str] = []
    compiler._flat(top, lines, "", body, leaves)
    if sorted(params) != sorted(leaves):
        missing, extra = set(leaves) - set(params), set(params) - set(leaves)
        raise TypeError(
            f"flat writer for {top}/{body}: missing {sorted(missing)}, unknown {sorted(extra)}"
        )
    write: Callable[..., bytes] = compiler._function(
        ", ".join(params), lines, prefix, f"flat {top}/{body}"
    )
    return write


def compile_writer(
    schema: dict[str, Any], classes: dict[str, type], *, prefix: bytes = b""
) -> Writer:
    """A function ``record -> prefix + Avro binary body`` for ``schema``, reading the
    attributes of the typed records whose classes are given by full Avro name. ``prefix`` (a
    wire header) is written first, so the body is never copied behind it."""
    compiler = _Compiler(classes)
    lines: list[str] = []
    compiler._emit(schema, "", lines, "    ", "record")
    write: Writer = compiler._function("record", lines, prefix, schema.get("name", "?"))
    return write
