"""A compiled Avro binary reader for rollstream's typed records (the mirror of fastwrite.py).

fastavro reads into dicts: decoding a record walks the schema for every record, builds a dict
per record, and ``from_avro`` then walks the dict again to make the typed record. Every
processor decodes every event, so the codec compiles, once per schema, a reader: each named
record becomes one generated Python function whose body is the record's fields as straight-line
read steps (varints, strings, packed arrays via ``np.frombuffer``, unions as an if-chain), ending
in the record's object: its slots set directly when that is what its ``__init__`` would do
(``_direct``), else one call of the class. Records come out as the classes ``from_avro`` would
build, equal field for field and type for type (a test checks it against fastavro on generated
records of every type, and on mangled bytes).

The reader reads the writer schema's layout only: no schema resolution (the codec uses it when
the writer schema is the reader schema, and fastavro's resolution otherwise).

Bad bytes raise ``ReadError`` (truncated input, a bad union or enum index, a negative length,
a varint longer than 10 bytes, invalid UTF-8, an array length that is not a whole number of
items); never IndexError or struct.error. Where fastavro accepts garbage (an enum index of -1
reads as the last symbol there) this reader refuses it.

Supported: the types rollstream's schemas use — null, boolean, int, long, float, double, string,
bytes (packed numpy arrays for the fields a class lists in ``_arrays``), fixed, enum (converted
to the class's ``_enums`` type), record, array, map, and unions of those. Logical types are not
supported (``compile_reader`` raises TypeError; the codec then keeps fastavro).
"""

from __future__ import annotations

import dataclasses
import keyword
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from .codegen import CodeGen, full_name

__all__ = ["ReadError", "Reader", "compile_reader"]

Reader = Callable[[bytes, int], tuple[Any, int]]  # (data, offset) -> (record, end offset)

_MASK64 = (1 << 64) - 1
_PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "string", "bytes"})


class ReadError(ValueError):
    """The bytes are not an encoding of the schema."""


def _tail(data: bytes, pos: int, b: int) -> tuple[int, int]:
    """The rest of a zig-zag varint whose first byte ``b`` (high bit set) was before ``pos``
    (the generated code reads varints of one and two bytes itself)."""
    n = b & 0x7F
    shift = 7
    while True:
        b = data[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            break
        shift += 7
        if shift > 63:
            raise ReadError(f"varint longer than 10 bytes at byte {pos}")
    n &= _MASK64
    return (n >> 1) ^ -(n & 1), pos


def _bad_length(kind: str, n: int, pos: int, size: int) -> ReadError:
    if n < 0:
        return ReadError(f"negative {kind} length {n} at byte {pos}")
    return ReadError(f"truncated: {kind} of {n} bytes at byte {pos}, {size - pos} left")


def _bad_index(kind: str, index: int, count: int, pos: int) -> ReadError:
    return ReadError(f"bad {kind} index {index} (of {count}) before byte {pos}")


def _bad_count(count: int, pos: int, size: int) -> ReadError:
    return ReadError(f"truncated: block of {count} items at byte {pos}, {size - pos} bytes left")


class _Compiler(CodeGen):
    """Generates the source of one function per named record and execs it once."""

    def __init__(self, classes: dict[str, type]) -> None:
        env: dict[str, Any] = {
            "_tail": _tail,
            "_bad_length": _bad_length,
            "_bad_index": _bad_index,
            "_bad_count": _bad_count,
            "_frombuffer": np.frombuffer,
            "_unpack_d": struct.Struct("<d").unpack_from,
            "_unpack_f": struct.Struct("<f").unpack_from,
        }
        super().__init__(classes, env)
        self.enums: dict[str, list[str]] = {}  # full name -> symbols
        self.fixed: dict[str, int] = {}  # full name -> size

    # --- schema walking -------------------------------------------------------------------

    def _define(self, schema: Any, namespace: str) -> Any:
        """Register the named types defined inline in ``schema`` (records compile on first
        sight); returns the schema with its type resolved for emitting."""
        if isinstance(schema, dict):
            kind = schema.get("type")
            if "logicalType" in schema:
                raise TypeError(f"logical types are not supported: {schema['logicalType']}")
            if kind == "record":
                self._record(schema, namespace)
            elif kind == "enum":
                full = full_name(schema["name"], schema.get("namespace", namespace))
                self.enums[full] = list(schema["symbols"])
            elif kind == "fixed":
                full = full_name(schema["name"], schema.get("namespace", namespace))
                self.fixed[full] = int(schema["size"])
        return schema

    def _long(self, out: list[str], ind: str, target: str) -> None:
        out += [
            f"{ind}b = data[pos]",
            f"{ind}pos += 1",
            f"{ind}if b < 128:",
            f"{ind}    {target} = (b >> 1) ^ -(b & 1)",
            f"{ind}elif data[pos] < 128:",  # two bytes (a length up to 8 KiB)
            f"{ind}    b = (b & 127) | (data[pos] << 7)",
            f"{ind}    pos += 1",
            f"{ind}    {target} = (b >> 1) ^ -(b & 1)",
            f"{ind}else:",
            f"{ind}    {target}, pos = _tail(data, pos, b)",
        ]

    def _span(self, out: list[str], ind: str, kind: str) -> None:
        """Reads a length; leaves ``end`` past the bytes it announces (checked)."""
        self._long(out, ind, "n")
        out += [
            f"{ind}end = pos + n",
            f"{ind}if n < 0 or end > size:",
            f"{ind}    raise _bad_length({kind!r}, n, pos, size)",
        ]

    def _emit(
        self,
        schema: Any,
        namespace: str,
        out: list[str],
        ind: str,
        target: str,
        dtype: np.dtype[Any] | None = None,
    ) -> None:
        """Lines that read one value of ``schema`` at ``pos`` into ``target``."""
        schema = self._define(schema, namespace)
        if isinstance(schema, list):
            self._union(schema, namespace, out, ind, target)
            return
        if isinstance(schema, dict):
            kind = schema["type"]
            if kind in ("record", "enum", "fixed"):
                name = full_name(schema["name"], schema.get("namespace", namespace))
                self._named(name, out, ind, target)
            elif kind == "array":
                self._array(schema["items"], namespace, out, ind, target)
            elif kind == "map":
                self._map(schema["values"], namespace, out, ind, target)
            elif isinstance(kind, str | list | dict):
                self._emit(kind, namespace, out, ind, target, dtype)
            else:
                raise TypeError(f"unsupported schema: {schema!r}")
            return
        if not isinstance(schema, str):
            raise TypeError(f"unsupported schema: {schema!r}")
        if schema not in _PRIMITIVES:
            self._named(full_name(schema, namespace), out, ind, target)
        elif schema == "null":
            out.append(f"{ind}{target} = None")
        elif schema == "boolean":
            out += [f"{ind}{target} = data[pos] != 0", f"{ind}pos += 1"]
        elif schema in ("int", "long"):
            self._long(out, ind, target)
        elif schema in ("double", "float"):
            unpack, width = ("_unpack_d", 8) if schema == "double" else ("_unpack_f", 4)
            out += [f"{ind}{target} = {unpack}(data, pos)[0]", f"{ind}pos += {width}"]
        elif schema == "string":
            self._span(out, ind, "string")
            out += [f"{ind}{target} = data[pos:end].decode()", f"{ind}pos = end"]
        else:  # bytes
            self._span(out, ind, "bytes")
            if dtype is None:
                out.append(f"{ind}{target} = data[pos:end]")
            else:
                dt = self._const(dtype, "dtype")
                out.append(f"{ind}{target} = _frombuffer(data[pos:end], {dt})")
            out.append(f"{ind}pos = end")

    def _named(self, name: str, out: list[str], ind: str, target: str) -> None:
        if name in self.records:
            out.append(f"{ind}{target}, pos = {self.records[name]}(data, pos, size)")
        elif name in self.enums:
            symbols = self.enums[name]
            table = self._const(symbols, "symbols")
            index = self._var("i")
            self._long(out, ind, index)
            out += [
                f"{ind}if not 0 <= {index} < {len(symbols)}:",
                f"{ind}    raise _bad_index('enum', {index}, {len(symbols)}, pos)",
                f"{ind}{target} = {table}[{index}]",
            ]
        elif name in self.fixed:
            size = self.fixed[name]
            out += [
                f"{ind}end = pos + {size}",
                f"{ind}if end > size:",
                f"{ind}    raise _bad_length('fixed', {size}, pos, size)",
                f"{ind}{target} = data[pos:end]",
                f"{ind}pos = end",
            ]
        else:
            raise TypeError(f"unknown named type {name!r}")

    def _union(
        self, branches: list[Any], namespace: str, out: list[str], ind: str, target: str
    ) -> None:
        index = self._var("u")
        self._long(out, ind, index)
        for i, branch in enumerate(branches):
            out.append(f"{ind}{'if' if i == 0 else 'elif'} {index} == {i}:")
            self._emit(branch, namespace, out, ind + "    ", target)
        out += [
            f"{ind}else:",
            f"{ind}    raise _bad_index('union', {index}, {len(branches)}, pos)",
        ]

    def _blocks(self, out: list[str], ind: str, count: str, loop: list[str]) -> None:
        """The block loop of an array or map around ``loop`` (lines at ind + 8 spaces)."""
        out.append(f"{ind}while True:")
        self._long(out, ind + "    ", count)
        out += [
            f"{ind}    if {count} == 0:",
            f"{ind}        break",
            f"{ind}    if {count} < 0:",
            f"{ind}        {count} = -{count}",
        ]
        self._long(out, ind + "        ", "n")  # the block's size in bytes: unused
        out += [
            f"{ind}    if {count} > size - pos:",  # every item takes at least one byte
            f"{ind}        raise _bad_count({count}, pos, size)",
            f"{ind}    for _ in range({count}):",
            *loop,
        ]

    def _array(self, items: Any, namespace: str, out: list[str], ind: str, target: str) -> None:
        acc, item, count = self._var("a"), self._var("x"), self._var("c")
        loop: list[str] = []
        inner = ind + "        "
        self._emit(items, namespace, loop, inner, item)
        loop.append(f"{inner}{acc}.append({item})")
        if _may_be_empty(self, items, namespace):
            raise TypeError("arrays of zero-width items are not supported")
        out.append(f"{ind}{acc} = []")
        self._blocks(out, ind, count, loop)
        out.append(f"{ind}{target} = {acc}")

    def _map(self, values: Any, namespace: str, out: list[str], ind: str, target: str) -> None:
        acc, key, item, count = self._var("m"), self._var("k"), self._var("x"), self._var("c")
        loop: list[str] = []
        inner = ind + "        "
        self._emit("string", namespace, loop, inner, key)
        self._emit(values, namespace, loop, inner, item)
        loop.append(f"{inner}{acc}[{key}] = {item}")
        out.append(f"{ind}{acc} = {{}}")
        self._blocks(out, ind, count, loop)
        out.append(f"{ind}{target} = {acc}")

    def _record(self, schema: dict[str, Any], namespace: str) -> None:
        full = full_name(schema["name"], schema.get("namespace", namespace))
        if full in self.records:
            raise TypeError(f"record {full} defined twice")
        cls = self.classes.get(full)
        if cls is None or not dataclasses.is_dataclass(cls):
            raise TypeError(f"record {full} has no record class")
        for ident in (full.rpartition(".")[2], *(f["name"] for f in schema["fields"])):
            if not ident.isidentifier() or keyword.iskeyword(ident):  # names go into the code
                raise TypeError(f"record {full}: {ident!r} is not a Python identifier")
        func = f"_read_{len(self.records)}_{full.rpartition('.')[2]}"
        self.records[full] = func  # before the fields: recursive references resolve
        ns = full.rpartition(".")[0]
        wanted = {f.name for f in dataclasses.fields(cls) if f.init}
        names = [f["name"] for f in schema["fields"]]
        if not wanted <= set(names):
            raise TypeError(
                f"{cls.__name__} has fields {sorted(wanted - set(names))} not in {full}"
            )
        arrays: dict[str, np.dtype[Any]] = getattr(cls, "_arrays", {})
        enums: dict[str, type] = getattr(cls, "_enums", {})
        saved, self._temp = self._temp, 0
        body: list[str] = [f"def {func}(data, pos, size):"]
        args = []
        for i, fld in enumerate(schema["fields"]):
            name = fld["name"]
            target = f"f{i}" if name in wanted else "_"
            dtype = arrays.get(name)
            ftype = fld["type"]
            if dtype is not None and _resolved(ftype) != "bytes":
                raise TypeError(f"{full}.{name}: packed array field is not bytes")
            if name in enums and self._is_enum(ftype, ns):
                self._enum_field(ftype, ns, enums[name], body, "    ", target)
            else:
                self._emit(ftype, ns, body, "    ", target, dtype)
                if name in enums and name in wanted:
                    conv = self._const(enums[name], "enum")
                    body.append(f"    {target} = {conv}({target})")
            if name in wanted:
                args.append(f"{name}=f{i}")
        cls_name = self._const(cls, cls.__name__)
        if _direct(cls, wanted):  # bypass __init__: set the slots (see _direct)
            new = self._const(object.__new__, "new")
            body.append(f"    r = {new}({cls_name})")
            body += [f"    r.{arg.replace('=', ' = ')}" for arg in args]
            body.append("    return r, pos")
        else:
            body.append(f"    return {cls_name}({', '.join(args)}), pos")
        self._temp = saved
        self.sources.append("\n".join(body))

    def _is_enum(self, ftype: Any, namespace: str) -> bool:
        if isinstance(ftype, dict) and ftype.get("type") == "enum":
            return True
        return isinstance(ftype, str) and full_name(ftype, namespace) in self.enums

    def _enum_field(
        self, ftype: Any, namespace: str, enum_type: type, out: list[str], ind: str, target: str
    ) -> None:
        """An enum field read straight into the class's enum members (a symbol the enum type
        does not know is a compile error, as it would fail every decode)."""
        self._define(ftype, namespace)
        name = (
            full_name(ftype["name"], ftype.get("namespace", namespace))
            if isinstance(ftype, dict)
            else full_name(ftype, namespace)
        )
        symbols = self.enums[name]
        try:
            members = [enum_type(s) for s in symbols]
        except ValueError as exc:
            raise TypeError(f"enum {name} does not fit {enum_type.__name__}: {exc}") from exc
        table = self._const(members, "members")
        index = self._var("i")
        self._long(out, ind, index)
        out += [
            f"{ind}if not 0 <= {index} < {len(symbols)}:",
            f"{ind}    raise _bad_index('enum', {index}, {len(symbols)}, pos)",
            f"{ind}{target} = {table}[{index}]",
        ]


def _direct(cls: type, fields: set[str]) -> bool:
    """Whether a record may be built by setting its slots instead of calling the class: a
    slotted, unfrozen dataclass whose fields all come from the schema and whose
    ``__post_init__`` is absent or is one ``events._Record`` made (which only coerces packed
    arrays and enums, and the reader already makes those). Anything else is called (slower,
    same result)."""
    post_init = getattr(cls, "__post_init__", None)
    return (
        "__slots__" in cls.__dict__
        and cls.__setattr__ is object.__setattr__
        and {f.name for f in dataclasses.fields(cls)} == fields
        and (post_init is None or getattr(post_init, "is_coercer", False))
    )


def _resolved(ftype: Any) -> Any:
    while isinstance(ftype, dict) and isinstance(ftype.get("type"), str | dict):
        if ftype["type"] in ("record", "enum", "fixed", "array", "map"):
            return ftype["type"]
        ftype = ftype["type"]
    return ftype


def _may_be_empty(compiler: _Compiler, schema: Any, namespace: str) -> bool:
    """True when a value of ``schema`` can take zero bytes (null, empty record, fixed 0)."""
    if isinstance(schema, list):
        return False  # the branch index takes a byte
    if isinstance(schema, dict):
        kind = schema["type"]
        if kind == "record":
            ns = full_name(schema["name"], schema.get("namespace", namespace)).rpartition(".")[0]
            return all(_may_be_empty(compiler, f["type"], ns) for f in schema["fields"])
        if kind == "fixed":
            return int(schema["size"]) == 0
        if isinstance(kind, str | list | dict) and kind not in ("enum", "array", "map"):
            return _may_be_empty(compiler, kind, namespace)
        return False
    if schema == "null":
        return True
    full = full_name(schema, namespace)
    return compiler.fixed.get(full, 1) == 0


def compile_reader(schema: dict[str, Any], classes: dict[str, type]) -> Reader:
    """A function ``(data, offset) -> (record, end)`` reading the Avro binary body of
    ``schema`` (self-contained, as ``codec.load_schema`` gives it) into the typed records whose
    classes are given by full Avro name. Raises TypeError for a schema or class it cannot
    read; the returned function raises only ``ReadError`` on bad bytes."""
    compiler = _Compiler(classes)
    lines: list[str] = []
    compiler._emit(schema, "", lines, "    ", "value")
    source = "\n\n".join(
        [
            *compiler.sources,
            "def _read_top(data, pos, size):\n" + "\n".join(lines) + "\n    return value, pos",
        ]
    )
    env = compiler.env
    exec(compile(source, f"<fastread {schema.get('name', '?')}>", "exec"), env)
    top = env["_read_top"]

    def read(data: bytes, pos: int = 0) -> tuple[Any, int]:
        try:
            return top(data, pos, len(data))
        except ReadError:
            raise
        except (IndexError, struct.error) as exc:
            raise ReadError(f"truncated: {exc}") from exc
        except Exception as exc:  # bad UTF-8, an array length not a whole number of items
            raise ReadError(f"{type(exc).__name__}: {exc}") from exc

    read.source = source  # type: ignore[attr-defined]  # for debugging
    return read
