"""The read-only gate of every ad-hoc query (analytics server, ``rollstream report``). Pure.

A query reaches the engine only through three gates; each would refuse the ways out on its own
where it can see them:

1. ``check_read_only(sql, database=)``: our own lexer (strings with ``\\`` and doubled quotes,
   quoted names, ``$tag$`` heredocs, nested ``/* */``, ``--`` and ``# `` comments, as
   ClickHouse reads them). One statement whose first word is SELECT, WITH, DESCRIBE/DESC,
   EXPLAIN, EXISTS (not EXISTS DATABASE) or ``SHOW TABLES`` (no FROM/IN); no ``INTO OUTFILE``,
   ``INFILE``, ``SETTINGS`` or ``FORMAT`` clause; no call of a function in ``DENIED_FUNCTIONS``
   (or with a prefix in ``DENIED_PREFIXES``): files, URLs, object stores, other servers,
   dictionaries, other databases' metadata, server settings, introspection, sleeps; quoted
   names with control characters or backslashes are refused (nothing to misread). With
   ``database``, a dotted name whose head is a system database (``SYSTEM_DATABASES``) or another
   database of the same family (``rollstream_*`` beside ``rollstream``) is refused.
2. ``check_ast(lines, database=)``: the engine's own parse of the statement (the lines of
   ``EXPLAIN AST <sql>``, which parses and does not run it), so a difference between our lexer
   and ClickHouse's cannot smuggle anything past: every table (``TableIdentifier``, and the
   table on the right of IN) is unqualified or in ``database``; every function under a
   ``TableExpression`` is in ``TABLE_FUNCTIONS`` (numbers, zeros, values, view, ...); no
   function is denied; no ``SETTINGS`` (``Set``) and no ``INTO OUTFILE`` (a literal beside the
   query); the statement kind is one of ``AST_STATEMENTS``.
3. ``readonly_settings``: the querying session's settings, limits first (``max_execution_time``,
   ``max_result_rows`` / ``max_result_bytes`` with ``result_overflow_mode=throw``,
   ``max_memory_usage``, ``allow_introspection_functions=0``), then ``readonly=1``: no writes,
   no DDL, no file/url/remote/executable/... table functions, and a query's ``SETTINGS`` can
   change none of them (chDB honours all of these:
   tests/integration/test_analytics_lockdown_chdb.py).

Every refusal is a ``RefusedQuery`` whose message names the reason.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollstream.consumers.errors import RefusedQuery

__all__ = [
    "AST_STATEMENTS",
    "DENIED_FUNCTIONS",
    "DENIED_PREFIXES",
    "READ_KEYWORDS",
    "SYSTEM_DATABASES",
    "TABLE_FUNCTIONS",
    "AstNode",
    "Token",
    "check_ast",
    "check_read_only",
    "denied_function",
    "parse_ast",
    "readonly_settings",
    "tokenize",
]

READ_KEYWORDS = frozenset({"SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXPLAIN", "EXISTS"})
SYSTEM_DATABASES = frozenset({"system", "information_schema", "default"})


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


# table functions a query may read from (lower case): generated rows, literals, subqueries
TABLE_FUNCTIONS = _words(
    """numbers numbers_mt zeros zeros_mt generate_series generateseries values view
    generaterandom format null"""
)
# functions no query may call, scalar or table (lower case)
DENIED_FUNCTIONS = _words(
    # files, URLs, object stores, other servers and engines
    """file filecluster url urlcluster s3 s3cluster gcs oss cosn hdfs hdfscluster remote
    remotesecure cluster clusterallreplicas mysql postgresql mongodb redis sqlite odbc jdbc
    input executable arrowflight ytsaurus loop merge viewifpermitted catboostevaluate
    modelevaluate naivebayesclassifier"""
    # other databases' metadata and the server's configuration
    """ hascolumnintable getmacro showcertificate getclienthttpheader hostname fqdn displayname
    serveruuid getoskernelversion tcpport getserverport currentuser currentroles enabledroles
    defaultroles currentprofiles zookeepersessionuptime"""
    # introspection, the server log, sleeps (a sleeping query holds the query client)
    """ addresstoline addresstolinewithinlines addresstosymbol demangle trap logtrace sleep
    sleepeachrow"""
)
DENIED_PREFIXES = tuple(
    sorted(
        _words(
            """azureblobstorage iceberg deltalake hudi paimon dict joinget timeseries
            filesystem mergetree getsetting getserversetting getmergetreesetting __"""
        )
    )
)
# statement kinds of EXPLAIN AST's first line
AST_STATEMENTS = frozenset(
    {"SelectWithUnionQuery", "DescribeQuery", "ExistsTableQuery", "ShowTables", "Explain"}
)
_IN_FUNCTIONS = _words(
    "in notin globalin globalnotin nullin notnullin globalnullin globalnotnullin"
)
_CLAUSES = {
    "INTO": "INTO OUTFILE is not allowed",
    "OUTFILE": "INTO OUTFILE is not allowed",
    "INFILE": "FROM INFILE is not allowed",
    "SETTINGS": "a SETTINGS clause is not allowed: the server's limits apply",
    "FORMAT": "a FORMAT clause is not allowed: the server chooses the format",
}
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")
_NUMBER = re.compile(r"[0-9][0-9.]*")
_HEREDOC = re.compile(r"\$([A-Za-z0-9_]*)\$")


def denied_function(name: str) -> bool:
    """True for a function no query may call (case-insensitive)."""
    low = name.lower()
    return low in DENIED_FUNCTIONS or low.startswith(DENIED_PREFIXES)


# --- 1. tokens ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Token:
    """``kind``: word, name (a quoted identifier, unquoted), string, number or punct."""

    kind: str
    text: str
    piece: int  # index in the lexer's pieces (the statement without comments)


def _quoted_end(sql: str, i: int) -> int:
    """The index after the quote that closes the one at ``i`` (``\\`` escapes, doubled quotes)."""
    quote, j, n = sql[i], i + 1, len(sql)
    while j < n:
        ch = sql[j]
        if ch == "\\":
            j += 2
        elif ch == quote:
            if j + 1 < n and sql[j + 1] == quote:
                j += 2
            else:
                return j + 1
        else:
            j += 1
    raise RefusedQuery("unterminated quote")


def _comment_end(sql: str, i: int) -> int:
    """The index after the comment starting at ``i``; ClickHouse nests ``/* */``."""
    if sql.startswith("/*", i):
        depth, j = 1, i + 2
        while depth:
            close, reopen = sql.find("*/", j), sql.find("/*", j)
            if close < 0:
                raise RefusedQuery("unterminated comment")
            if 0 <= reopen < close:
                depth, j = depth + 1, reopen + 2
            else:
                depth, j = depth - 1, close + 2
        return j
    end = sql.find("\n", i)
    return len(sql) if end < 0 else end


def _lex(sql: str) -> tuple[list[Token], list[str]]:
    """(tokens, pieces): pieces are the statement's text with each comment replaced by a space;
    each token knows its piece."""
    tokens: list[Token] = []
    pieces: list[str] = []
    i, n = 0, len(sql)

    def emit(kind: str, text: str, end: int) -> None:
        tokens.append(Token(kind, text, len(pieces)))
        pieces.append(sql[i:end])

    while i < n:
        ch = sql[i]
        if ch.isspace():
            j = i + 1
            while j < n and sql[j].isspace():
                j += 1
            pieces.append(sql[i:j])
        elif sql.startswith(("--", "/*", "# ", "#!"), i):
            j = _comment_end(sql, i)
            pieces.append(" ")
        elif ch == "'":
            j = _quoted_end(sql, i)
            emit("string", sql[i:j], j)
        elif ch in '"`':
            j = _quoted_end(sql, i)
            name = sql[i + 1 : j - 1].replace(ch * 2, ch)
            if "\\" in name or any(ord(c) < 32 or ord(c) == 127 for c in name):
                raise RefusedQuery(f"quoted name {sql[i:j]!r} has a backslash or control character")
            emit("name", name, j)
        elif (m := _HEREDOC.match(sql, i)) is not None:
            close = sql.find(m.group(0), m.end())
            if close < 0:
                raise RefusedQuery("unterminated heredoc")
            j = close + len(m.group(0))
            emit("string", sql[i:j], j)
        elif (m := _WORD.match(sql, i)) is not None:
            j = m.end()
            emit("word", m.group(0), j)
        elif (m := _NUMBER.match(sql, i)) is not None:
            j = m.end()
            emit("number", m.group(0), j)
        else:
            j = i + 1
            emit("punct", ch, j)
        i = j
    return tokens, pieces


def tokenize(sql: str) -> list[Token]:
    """The statement's tokens, comments and whitespace left out (RefusedQuery when a quote,
    heredoc or comment is not closed)."""
    return _lex(sql)[0]


def _is_name(token: Token) -> bool:
    return token.kind in ("word", "name")


def _foreign(head: str, database: str) -> bool:
    """A database other than ``database`` that the head of a dotted name could be."""
    low = head.lower()
    if low in SYSTEM_DATABASES:
        return True
    family = database.split("_", 1)[0].lower()
    return low != database.lower() and (low == family or low.startswith(family + "_"))


def check_read_only(sql: str, *, database: str | None = None) -> str:
    """The statement without comments (and without a trailing ``;``) if it is one read-only
    query that calls no denied function (and, with ``database``, names no other database);
    else RefusedQuery naming the reason."""
    tokens, pieces = _lex(sql)
    cut = len(tokens)
    while cut and tokens[cut - 1].text == ";":
        cut -= 1
    text = "".join(pieces[: tokens[cut].piece] if cut < len(tokens) else pieces).strip()
    tokens = tokens[:cut]
    if not tokens:
        raise RefusedQuery("empty statement")
    if any(t.text == ";" for t in tokens):
        raise RefusedQuery("one statement at a time")
    words = [t.text.upper() for t in tokens if t.kind == "word"]
    first = next((t for t in tokens if t.text != "("), tokens[0])
    if first.kind != "word" or first.text.upper() not in READ_KEYWORDS:
        raise RefusedQuery(
            f"only {', '.join(sorted(READ_KEYWORDS))} statements are allowed, not {first.text}"
        )
    lead = first.text.upper()
    if lead == "SHOW" and (words[1:2] != ["TABLES"] or {"FROM", "IN"} & set(words)):
        raise RefusedQuery("SHOW is allowed as SHOW TABLES only (this database's tables)")
    if lead == "EXISTS" and "DATABASE" in words[1:3]:
        raise RefusedQuery("EXISTS DATABASE is not allowed")
    for k, token in enumerate(tokens):
        nxt = tokens[k + 1] if k + 1 < len(tokens) else None
        clause = token.text.upper() if token.kind == "word" else ""
        if clause in _CLAUSES and not (nxt is not None and nxt.text == "("):  # format(...)
            raise RefusedQuery(_CLAUSES[clause])
        if not _is_name(token) or nxt is None:
            continue
        if nxt.text == "(" and denied_function(token.text):
            raise RefusedQuery(
                f"function {token.text}() is not allowed: it reaches files, URLs, other "
                "servers or databases, or the server itself"
            )
        after = tokens[k + 2] if k + 2 < len(tokens) else None
        head = nxt.text == "." and after is not None and _is_name(after)
        head = head and (k == 0 or tokens[k - 1].text != ".")  # the first name of a chain
        if database is not None and head and _foreign(token.text, database):
            raise RefusedQuery(f"database {token.text} is not visible: queries see {database} only")
    return text


# --- 2. the engine's parse ------------------------------------------------------------------


@dataclass(slots=True)
class AstNode:
    """One line of ``EXPLAIN AST``: ``kind`` (Function, TableIdentifier, ...), ``rest`` (the
    line after the kind, ``(children N)`` removed) and its children."""

    kind: str
    rest: str
    depth: int
    children: list[AstNode] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The first word of ``rest``: a function's or an identifier's name."""
        return self.rest.split(" ", 1)[0]


_CHILDREN = re.compile(r" \(children \d+\)$")


def parse_ast(lines: Sequence[str]) -> list[AstNode]:
    """The roots of an ``EXPLAIN AST`` dump (one space of indent per level)."""
    roots: list[AstNode] = []
    stack: list[AstNode] = []
    for line in lines:
        body = line.lstrip(" ")
        if not body:
            continue
        depth = len(line) - len(body)
        kind, _, rest = body.partition(" ")
        node = AstNode(kind, _CHILDREN.sub("", rest), depth)
        while stack and stack[-1].depth >= depth:
            stack.pop()
        (stack[-1].children if stack else roots).append(node)
        stack.append(node)
    return roots


def _check_table(text: str, database: str) -> None:
    """A table reference (``db.table`` or ``table``, maybe ``(alias x)``) inside ``database``."""
    if "." in text and text.split(".", 1)[0] != database:
        raise RefusedQuery(f"table {text.split(' ', 1)[0]} is outside {database}")


def _check_node(node: AstNode, parent: AstNode | None, database: str) -> None:
    if node.kind == "Function":
        if denied_function(node.name):
            raise RefusedQuery(f"function {node.name}() is not allowed")
        in_from = parent is not None and parent.kind == "TableExpression"
        if in_from and node.name.lower() not in TABLE_FUNCTIONS:
            raise RefusedQuery(
                f"table function {node.name}() is not allowed; allowed: "
                f"{', '.join(sorted(TABLE_FUNCTIONS))}"
            )
    elif node.kind == "TableIdentifier":
        _check_table(node.rest, database)
    elif node.kind == "Identifier" and "." in node.rest:
        if node.rest.split(".", 1)[0].lower() in SYSTEM_DATABASES:
            raise RefusedQuery(f"{node.name} is outside {database}")
    elif node.kind == "Set":
        raise RefusedQuery(_CLAUSES["SETTINGS"])
    elif node.kind == "ExistsTableQuery":
        db = node.rest.split(" ", 1)[0]
        if db and db != database:
            raise RefusedQuery(f"database {db} is not visible: queries see {database} only")
    for k, child in enumerate(node.children):
        _check_node(child, node, database)
        if (
            node.kind == "ExpressionList"
            and parent is not None
            and parent.kind == "Function"
            and parent.name.lower() in _IN_FUNCTIONS
            and k == 1
            and child.kind == "Identifier"
        ):
            _check_table(child.rest, database)  # x IN db.table


def check_ast(lines: Sequence[str], *, database: str) -> None:
    """RefusedQuery unless the ``EXPLAIN AST`` dump of a statement is an allowed statement that
    reads only ``database`` and calls no denied function (see the module docstring)."""
    roots = parse_ast(lines)
    if not roots:
        raise RefusedQuery("the engine parsed nothing")
    root = roots[0]
    if len(roots) != 1 or root.kind not in AST_STATEMENTS:
        raise RefusedQuery(f"statement {root.kind} is not allowed")
    for node in (root, *root.children):  # INTO OUTFILE 'x': a literal beside the query
        if node.kind in AST_STATEMENTS and any(c.kind == "Literal" for c in node.children):
            raise RefusedQuery(_CLAUSES["OUTFILE"])
    # SHOW TABLES's identifiers: FROM db, and the FORMAT the client adds
    shown = {c.name for c in root.children if c.kind == "Identifier"} - {database, "Native"}
    if root.kind == "ShowTables" and shown:
        raise RefusedQuery("SHOW is allowed as SHOW TABLES only (this database's tables)")
    _check_node(root, None, database)


# --- 3. the engine's limits -----------------------------------------------------------------


def readonly_settings(
    max_execution_time_s: float,
    max_result_rows: int,
    max_memory_bytes: int = 0,
    *,
    max_result_bytes: int = 0,
) -> dict[str, Any]:
    """Session settings of a querying client, limits first: once ``readonly=1`` is set nothing
    can be changed any more (neither by us nor by a query's SETTINGS clause). 0 leaves a
    byte limit at the engine's default."""
    out: dict[str, Any] = {
        "max_execution_time": max_execution_time_s,
        "max_result_rows": max_result_rows,
        "result_overflow_mode": "throw",
        "allow_introspection_functions": 0,
    }
    if max_result_bytes:
        out["max_result_bytes"] = max_result_bytes
    if max_memory_bytes:
        out["max_memory_usage"] = max_memory_bytes
    out["readonly"] = 1
    return out
