"""The analytics gate's pure parts (readonly.py): every way out of the namespace's database is
refused by our lexer and again by the check of the engine's own parse (EXPLAIN AST dumps as
chDB 26.9 prints them), and the queries analysts run (every canned view) still pass."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.consumers.analytics import reports
from rollstream.consumers.analytics.readonly import (
    DENIED_FUNCTIONS,
    TABLE_FUNCTIONS,
    check_ast,
    check_read_only,
    denied_function,
    parse_ast,
    readonly_settings,
    tokenize,
)
from rollstream.consumers.errors import RefusedQuery

DB = "rollstream_ns1"

# --- our lexer -------------------------------------------------------------------------------

WAYS_OUT = {
    # files, URLs, other servers: scalar and table functions
    "scalar file": "SELECT substring(file('/proc/self/environ'), 1, 30)",
    "quoted file": "SELECT `file`('/proc/self/environ')",
    "file with a comment before (": "SELECT file /* x */ ('/etc/hostname')",
    "table file": "SELECT * FROM file('/etc/hostname', 'LineAsString')",
    "url": "SELECT * FROM url('http://127.0.0.1:1/x', 'LineAsString')",
    "s3": "SELECT * FROM s3('http://127.0.0.1:1/b/x', 'CSV')",
    "remote": "SELECT * FROM remote('127.0.0.1', system.one)",
    "remoteSecure": "SELECT * FROM remoteSecure('127.0.0.1', 'db', 't')",
    "mysql": "SELECT * FROM mysql('h:3306', 'db', 't', 'u', 'p')",
    "postgresql": "SELECT * FROM postgresql('h:5432', 'db', 't', 'u', 'p')",
    "hdfs": "SELECT * FROM hdfs('hdfs://h:9000/x', 'TSV', 'a String')",
    "azureBlobStorage": "SELECT * FROM azureBlobStorage('DefaultEndpointsProtocol=x', 'c', 'b')",
    "input": "SELECT * FROM input('a String')",
    "executable": "SELECT * FROM executable('ls', 'TSV', 'x String')",
    "cluster": "SELECT * FROM cluster('default', system.one)",
    "sqlite": "SELECT * FROM sqlite('/tmp/x.db', 't')",
    "dictionary": "SELECT * FROM dictionary('d')",
    "dictGet": "SELECT dictGet('d', 'x', toUInt64(1))",
    "joinGet": "SELECT joinGet('db.t', 'v', 1)",
    "merge over system": "SELECT * FROM merge('system', '^tables$')",
    "mergeTreeIndex": "SELECT * FROM mergeTreeIndex('rollstream_ns2', 'events')",
    "hasColumnInTable": "SELECT hasColumnInTable('system', 'tables', 'name')",
    "getSetting": "SELECT getSetting('max_memory_usage')",
    "sleep": "SELECT sleepEachRow(1) FROM numbers(100)",
    # other databases
    "system table": "SELECT count() FROM system.tables",
    "quoted system table": 'SELECT count() FROM "system" . `tables`',
    "information schema": "SELECT * FROM INFORMATION_SCHEMA.tables",
    "another namespace": "SELECT count() FROM rollstream_ns2.events",
    "the live namespace": "SELECT count() FROM rollstream.events",
    "IN a system table": "SELECT 1 WHERE 1 IN system.one",
    "view over system": "SELECT * FROM view(SELECT * FROM system.one)",
    "describe system": "DESCRIBE TABLE system.tables",
    "exists system": "EXISTS TABLE system.one",
    "exists database": "EXISTS DATABASE system",
    "show databases": "SHOW DATABASES",
    "show tables from system": "SHOW TABLES FROM system",
    "show processlist": "SHOW PROCESSLIST",
    # clauses
    "into outfile": "SELECT 1 INTO OUTFILE '/tmp/x'",
    "from infile": "SELECT 1 FROM INFILE '/etc/hostname'",
    "settings override": "SELECT 1 SETTINGS max_execution_time = 100000",
    "settings readonly": "SELECT 1 SETTINGS readonly = 0",
    "format": "SELECT 1 FORMAT JSON",
    # smuggling past the lexer
    "heredoc": "SELECT $$'$$, file('/etc/hostname'), $$'$$",
    "tagged heredoc": "SELECT $a$'$a$, file('/etc/hostname'), $a$'$a$",
    "code after a nested comment": "SELECT 1 /* /* */ */ , file('/etc/hostname')",
    "doubled quote": "SELECT 'a''', file('/etc/hostname'), '''b'",
    "newline in a quoted name": "SELECT `a\nFunction file` FROM events",
    "backslash in a quoted name": "SELECT `a\\`b` FROM events",
}


@pytest.mark.parametrize("sql", list(WAYS_OUT.values()), ids=list(WAYS_OUT))
def test_every_way_out_is_refused_by_the_lexer(sql: str) -> None:
    with pytest.raises(RefusedQuery):
        check_read_only(sql, database=DB)


def test_refusals_name_the_reason() -> None:
    cases = {
        "SELECT file('/etc/passwd')": "function file() is not allowed",
        "SELECT * FROM system.tables": "database system is not visible",
        "SELECT * FROM rollstream_ns2.events": "database rollstream_ns2 is not visible",
        "SELECT 1 INTO OUTFILE 'x'": "INTO OUTFILE",
        "SELECT 1 SETTINGS readonly=0": "SETTINGS",
        "SELECT 1 FORMAT TSV": "FORMAT",
        "SHOW DATABASES": "SHOW TABLES only",
        "INSERT INTO events SELECT 1": "not INSERT",
        "SELECT 1; SELECT 2": "one statement",
    }
    for sql, reason in cases.items():
        with pytest.raises(RefusedQuery, match=re.escape(reason)):
            check_read_only(sql, database=DB)


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT count() FROM events",
        "SELECT count() FROM rollstream_ns1.events",  # its own database, qualified
        "SELECT e.rollout_id, e.ts FROM events AS e WHERE e.seq = 0",
        "SELECT t.1 FROM (SELECT (1, 2) AS t)",
        "SELECT format('{} {}', 'a', 'b')",  # format() the function, not the clause
        "SELECT * FROM numbers(10)",
        "SELECT * FROM values('x UInt8', 1, 2)",
        "SHOW TABLES",
        "SHOW TABLES LIKE 'e%'",
        "DESCRIBE TABLE events",
        "EXISTS TABLE events",
        "EXPLAIN SELECT 1",
        "SELECT 'file(1)', 'system.tables', 'INTO OUTFILE' AS x",
        "SELECT $$ file('x') ; $$",
        "SELECT 1 /* a /* nested */ comment */",
        "SELECT 1 /* /* */ , file('/etc/hostname') -- */",  # all of it one nested comment
        "SELECT 1 # a comment\n",
        "SELECT `mean reward` FROM (SELECT 1 AS `mean reward`)",
        "SELECT extract(DAY FROM e.ts) FROM events AS e",
        "SELECT {p:String}",
    ],
)
def test_analytics_queries_pass(sql: str) -> None:
    out = check_read_only(sql, database=DB)
    assert out and check_read_only(out, database=DB) == out


@pytest.mark.parametrize("view", list(reports.VIEWS))
def test_every_canned_view_passes_the_lexer(view: str) -> None:
    check_read_only(reports.render_sql(view, DB), database=DB)


def test_without_a_database_other_databases_are_left_to_the_engine() -> None:
    """``rollstream report`` on the store itself (the operator's own files) checks functions
    and clauses, not databases."""
    assert check_read_only("SELECT count() FROM system.parts") == "SELECT count() FROM system.parts"
    with pytest.raises(RefusedQuery, match="file"):
        check_read_only("SELECT file('/etc/hostname')")


def test_the_lexer_reads_quotes_heredocs_and_comments_as_clickhouse_does() -> None:
    kinds = [
        (t.kind, t.text) for t in tokenize("SELECT 'a\\'b''c', `x``y`, $t$ ' $t$ /* /* */ */ z")
    ]
    assert kinds == [
        ("word", "SELECT"),
        ("string", "'a\\'b''c'"),
        ("punct", ","),
        ("name", "x`y"),
        ("punct", ","),
        ("string", "$t$ ' $t$"),
        ("word", "z"),
    ]
    for bad in ("SELECT 'x", "SELECT `x", "SELECT $$x", "SELECT /* /* */"):
        with pytest.raises(RefusedQuery, match="unterminated"):
            tokenize(bad)


# --- hypothesis -----------------------------------------------------------------------------

_ANY_CASE = st.sampled_from(sorted(DENIED_FUNCTIONS)).flatmap(
    lambda name: st.lists(st.booleans(), min_size=len(name), max_size=len(name)).map(
        lambda ups: "".join(c.upper() if u else c for c, u in zip(name, ups, strict=True))
    )
)
_GAP = st.sampled_from(["", " ", "\n", "\t", " /* c */ ", "-- c\n", "# c\n", "/* /* n */ */"])


@given(name=_ANY_CASE, gap=_GAP, quote=st.sampled_from(["", "`", '"']), where=st.integers(0, 2))
def test_a_denied_function_is_refused_however_it_is_written(
    name: str, gap: str, quote: str, where: int
) -> None:
    call = f"{quote}{name}{quote}{gap}('x')"
    sql = [f"SELECT {call}", f"SELECT * FROM {call}", f"SELECT 1 WHERE 1 IN (SELECT {call})"]
    with pytest.raises(RefusedQuery):
        check_read_only(sql[where], database=DB)


_OTHER_DATABASES = "system SYSTEM information_schema INFORMATION_SCHEMA default rollstream"


@given(
    db=st.sampled_from([*_OTHER_DATABASES.split(), "rollstream_ns2"]),
    quote=st.sampled_from(["", "`", '"']),
    gap=_GAP,
)
def test_another_database_is_refused_however_it_is_written(db: str, quote: str, gap: str) -> None:
    with pytest.raises(RefusedQuery, match="not visible"):
        check_read_only(f"SELECT * FROM {quote}{db}{quote}{gap}.{gap}one", database=DB)


@settings(max_examples=400)
@given(st.text(alphabet=st.sampled_from(list("sf'\"`$/*-#\n;(). \\eiltSELCT")), max_size=60))
def test_any_text_is_accepted_or_refused_never_anything_else(text: str) -> None:
    for sql in (text, "SELECT " + text):
        try:
            out = check_read_only(sql, database=DB)
        except RefusedQuery:
            continue
        assert check_read_only(out, database=DB) == out  # what is sent passes again


# --- the engine's parse ---------------------------------------------------------------------


def _dump(text: str) -> list[str]:
    return text.strip("\n").split("\n")


SELECT_FROM = """
SelectWithUnionQuery (children 2)
 ExpressionList (children 1)
  SelectQuery (children 2)
   ExpressionList (children 1)
    Asterisk
   TablesInSelectQuery (children 1)
    TablesInSelectQueryElement (children 1)
     TableExpression (children 1)
      {table}
 Identifier Native
"""


@pytest.mark.parametrize(
    "table, reason",
    [
        ("TableIdentifier system.tables", "outside rollstream_ns1"),
        ("TableIdentifier rollstream_ns2.events (alias e)", "outside rollstream_ns1"),
        ("Function file (children 1)", "function file\\(\\) is not allowed"),
        ("Function mergeTreeIndex (children 1)", "not allowed"),
        ("Function dictionary (children 1)", "not allowed"),
        ("Function someNewTableFunction (children 1)", "table function someNewTableFunction"),
    ],
)
def test_the_engines_parse_of_a_way_out_is_refused(table: str, reason: str) -> None:
    with pytest.raises(RefusedQuery, match=reason):
        check_ast(_dump(SELECT_FROM.format(table=table)), database=DB)


@pytest.mark.parametrize(
    "table",
    [
        "TableIdentifier events",
        "TableIdentifier events (alias e)",
        "TableIdentifier rollstream_ns1.events",
        "Function numbers (children 1)",
        "Function view (children 1)",
    ],
)
def test_the_engines_parse_of_a_read_of_the_database_passes(table: str) -> None:
    check_ast(_dump(SELECT_FROM.format(table=table)), database=DB)


def test_in_a_foreign_table_settings_outfile_and_statements_are_refused() -> None:
    in_system = """
SelectWithUnionQuery (children 2)
 ExpressionList (children 1)
  SelectQuery (children 2)
   ExpressionList (children 1)
    Literal UInt64_1
   Function notIn (children 1)
    ExpressionList (children 2)
     Literal UInt64_1
     Identifier rollstream_ns2.events
 Identifier Native
"""
    with pytest.raises(RefusedQuery, match="outside"):
        check_ast(_dump(in_system), database=DB)
    settings_clause = """
SelectWithUnionQuery (children 2)
 ExpressionList (children 1)
  SelectQuery (children 2)
   ExpressionList (children 1)
    Literal UInt64_1
   Set
 Identifier Native
"""
    with pytest.raises(RefusedQuery, match="SETTINGS"):
        check_ast(_dump(settings_clause), database=DB)
    outfile = """
SelectWithUnionQuery (children 3)
 ExpressionList (children 1)
  SelectQuery (children 1)
   ExpressionList (children 1)
    Literal UInt64_1
 Literal 'x'
 Identifier Native
"""
    with pytest.raises(RefusedQuery, match="OUTFILE"):
        check_ast(_dump(outfile), database=DB)
    with pytest.raises(RefusedQuery, match="SHOW TABLES only"):
        check_ast(
            _dump("ShowTables (children 2)\n Identifier system\n Identifier Native"), database=DB
        )
    check_ast(_dump("ShowTables (children 1)\n Identifier Native"), database=DB)
    with pytest.raises(RefusedQuery, match="database system"):
        check_ast(
            _dump("ExistsTableQuery system one (children 3)\n Identifier system"), database=DB
        )
    check_ast(_dump("ExistsTableQuery  one (children 2)\n Identifier one"), database=DB)
    with pytest.raises(RefusedQuery, match="ExistsDatabaseQuery"):
        check_ast(_dump("ExistsDatabaseQuery system  (children 2)"), database=DB)
    with pytest.raises(RefusedQuery, match="parsed nothing"):
        check_ast([], database=DB)


def test_a_forged_line_can_only_add_a_refusal() -> None:
    """A quoted name with a newline prints a line of its own (chDB does not escape it); it can
    add a node, never hide one: the lexer refuses such names anyway."""
    forged = """
SelectWithUnionQuery (children 2)
 ExpressionList (children 1)
  SelectQuery (children 2)
   ExpressionList (children 1)
    Identifier a
Function file
 Identifier Native
"""
    with pytest.raises(RefusedQuery):
        check_ast(_dump(forged), database=DB)


def test_parse_ast_builds_the_tree() -> None:
    (root,) = parse_ast(_dump(SELECT_FROM.format(table="Function numbers (children 1)")))
    assert root.kind == "SelectWithUnionQuery" and [c.kind for c in root.children] == [
        "ExpressionList",
        "Identifier",
    ]
    function = root.children[0].children[0].children[1].children[0].children[0].children[0]
    assert (function.kind, function.name) == ("Function", "numbers")


def test_denied_and_table_function_lists_do_not_overlap() -> None:
    assert not {f for f in TABLE_FUNCTIONS if denied_function(f)}
    assert denied_function("dictGetString") and denied_function("ICEBERG_S3")
    assert not denied_function("sum") and not denied_function("quantileExactInclusive")


def test_session_settings_set_every_limit_before_readonly() -> None:
    s = readonly_settings(5.0, 100, 1 << 30, max_result_bytes=1 << 20)
    assert list(s)[-1] == "readonly" and s["readonly"] == 1
    assert s["max_execution_time"] == 5.0 and s["max_result_rows"] == 100
    assert s["max_memory_usage"] == 1 << 30 and s["max_result_bytes"] == 1 << 20
    assert s["result_overflow_mode"] == "throw" and s["allow_introspection_functions"] == 0
    assert "max_result_bytes" not in readonly_settings(5.0, 100)
