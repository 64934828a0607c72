"""What the compiled Avro reader (fastread.py) and writer (fastwrite.py) share: Avro full names
and the bookkeeping of a generated module (its globals, function names, temporaries)."""

from __future__ import annotations

from typing import Any

__all__ = ["CodeGen", "full_name"]


def full_name(name: str, namespace: str) -> str:
    return name if "." in name or not namespace else f"{namespace}.{name}"


class CodeGen:
    """Generated source for one function per named record: ``env`` holds the globals the code
    sees (constants are added with ``_const``), ``records`` maps a record's full name to its
    function's name, ``sources`` collects the functions' text."""

    def __init__(self, classes: dict[str, type], env: dict[str, Any]) -> None:
        self.classes = classes
        self.env = env
        self.records: dict[str, str] = {}  # full name -> function name
        self.sources: list[str] = []
        self._temp = 0

    def _const(self, value: Any, hint: str) -> str:
        name = f"_k{len(self.env)}_{hint}"
        self.env[name] = value
        return name

    def _var(self, hint: str) -> str:
        self._temp += 1
        return f"{hint}{self._temp}"
