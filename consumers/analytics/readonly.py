"""The read-only gate of every ad-hoc query (analytics server, ``rollstream report``). Pure.

Read-only is enforced twice: ``check_read_only`` admits one statement starting with SELECT,
WITH, SHOW, DESCRIBE/DESC, EXPLAIN or EXISTS (no INTO OUTFILE), and the querying client's
session runs with ``readonly_settings``: ``readonly=1`` (no writes, no DDL, no table functions,
no SETTINGS overrides) after ``max_execution_time``, ``max_result_rows``
(result_overflow_mode=throw) and optionally ``max_memory_usage`` were set.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

from rollstream.consumers.errors import RefusedQuery

__all__ = ["READ_KEYWORDS", "check_read_only", "readonly_settings"]

READ_KEYWORDS = frozenset({"SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXPLAIN", "EXISTS"})
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _scan(sql: str) -> tuple[str, str]:
    """(sql without comments, code only: string literals and quoted names blanked)."""
    out: list[str] = []
    code: list[str] = []
    i, n = 0, len(sql)
    while i < n:
        ch = sql[i]
        if sql.startswith("--", i) or ch == "#":
            end = sql.find("\n", i)
            i = n if end < 0 else end
            continue
        if sql.startswith("/*", i):
            end = sql.find("*/", i + 2)
            if end < 0:
                raise RefusedQuery("unterminated comment")
            out.append(" ")
            code.append(" ")
            i = end + 2
            continue
        if ch in "'\"`":
            j = i + 1
            while j < n and sql[j] != ch:
                j += 2 if sql[j] == "\\" else 1
            if j >= n:
                raise RefusedQuery("unterminated quote")
            out.append(sql[i : j + 1])
            code.append(" _ ")
            i = j + 1
            continue
        out.append(ch)
        code.append(ch)
        i += 1
    return "".join(out), "".join(code)


def check_read_only(sql: str) -> str:
    """The statement, comments removed, if it is one read-only query; else RefusedQuery."""
    text, code = _scan(sql)
    text, code = text.strip(), code.strip()
    while code.endswith(";"):
        code = code[:-1].rstrip()
        text = text[: text.rstrip().rfind(";")].rstrip()
    if not code:
        raise RefusedQuery("empty statement")
    if ";" in code:
        raise RefusedQuery("one statement at a time")
    words = [w.upper() for w in _WORD.findall(code)]
    if not words or words[0] not in READ_KEYWORDS:
        first = words[0] if words else code[:20]
        raise RefusedQuery(
            f"only {', '.join(sorted(READ_KEYWORDS))} statements are allowed, not {first}"
        )
    if any(a == "INTO" and b == "OUTFILE" for a, b in itertools.pairwise(words)):
        raise RefusedQuery("INTO OUTFILE is not allowed")
    return text


def readonly_settings(
    max_execution_time_s: float, max_result_rows: int, max_memory_bytes: int = 0
) -> dict[str, Any]:
    """Session settings of a querying client, limits first: once ``readonly=1`` is set nothing
    can be changed any more (neither by us nor by a query's SETTINGS clause)."""
    out: dict[str, Any] = {
        "max_execution_time": max_execution_time_s,
        "max_result_rows": max_result_rows,
        "result_overflow_mode": "throw",
    }
    if max_memory_bytes:
        out["max_memory_usage"] = max_memory_bytes
    out["readonly"] = 1
    return out
