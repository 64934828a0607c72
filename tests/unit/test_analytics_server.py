"""The analytics API's pure parts: the read-only gate, the session settings, the frames."""

from __future__ import annotations

import pytest

from rollstream.consumers.analytics.protocol import decode_frames, encode_frames
from rollstream.consumers.analytics.readonly import check_read_only, readonly_settings
from rollstream.consumers.errors import AnalyticsError, RefusedQuery


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT 1",
        "  select count() from events  ",
        "WITH x AS (SELECT 1) SELECT * FROM x",
        "(SELECT 1) UNION ALL (SELECT 2)",
        "SHOW TABLES",
        "DESCRIBE TABLE events",
        "desc events",
        "EXPLAIN SELECT 1",
        "EXISTS TABLE events",
        "SELECT 1;",
        "SELECT 1 ;  ",
        "-- a comment\nSELECT 1",
        "/* a comment */ SELECT 1",
        "SELECT 'a; b', \"c;d\" FROM t",
        "SELECT 'INTO OUTFILE' AS x",
        "SELECT 'it\\'s; DROP TABLE x'",
    ],
)
def test_read_only_statements_pass(sql: str) -> None:
    out = check_read_only(sql)
    assert out and not out.rstrip().endswith(";")


@pytest.mark.parametrize(
    "sql",
    [
        "",
        "  ;",
        "INSERT INTO events SELECT * FROM events",
        "DROP TABLE events",
        "ALTER TABLE events DELETE WHERE 1",
        "TRUNCATE TABLE events",
        "OPTIMIZE TABLE events FINAL",
        "SET readonly = 0",
        "SYSTEM STOP MERGES",
        "CREATE TABLE x (a UInt8) ENGINE = Memory",
        "SELECT 1; DROP TABLE events",
        "SELECT 1; SELECT 2",
        "/* SELECT */ DROP TABLE events",
        "-- SELECT\nDROP TABLE events",
        "SELECT 1 INTO OUTFILE '/tmp/x'",
        "select 1 into   outfile '/tmp/x'",
        "SELECT 'unterminated",
        "SELECT 1 /* unterminated",
        "KILL QUERY WHERE 1",
        "GRANT ALL ON *.* TO default",
    ],
)
def test_everything_else_is_refused(sql: str) -> None:
    with pytest.raises(RefusedQuery):
        check_read_only(sql)


def test_comments_are_removed_from_what_is_sent() -> None:
    assert check_read_only("SELECT 1 -- trailing\n") == "SELECT 1"
    assert "secret" not in check_read_only("SELECT /* secret */ 1")


def test_readonly_comes_last_in_the_session_settings() -> None:
    s = readonly_settings(5.0, 100, 1 << 30)
    assert list(s)[-1] == "readonly" and s["readonly"] == 1
    assert s["max_execution_time"] == 5.0 and s["max_result_rows"] == 100
    assert s["result_overflow_mode"] == "throw" and s["max_memory_usage"] == 1 << 30
    assert "max_memory_usage" not in readonly_settings(5.0, 100)


def test_frames_round_trip() -> None:
    records = [b"", b"a", b"\x00" * 70_000, b"rollout-1"]
    data = encode_frames(records)
    assert decode_frames(data) == records
    assert decode_frames(b"") == []
    for cut in (1, 5, len(data) - 1):
        with pytest.raises(AnalyticsError):
            decode_frames(data[:cut])
