"""The analytics server locked down, on real chDB (``serve`` in this process, on a store with
two namespaces' databases): every way out of the namespace's database is a 4xx naming the
reason, the analyst key is required, bodies and queries are bounded, bad input is never a 500,
the canned views still pass the whole gate, and the engine-side session settings hold on their
own (what chDB honours). A hypothesis run checks our lexer against the engine's own parse."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollstream.consumers.analytics import reports
from rollstream.consumers.analytics.readonly import check_read_only, readonly_settings
from rollstream.consumers.analytics.server import AnalyticsServer, serve
from rollstream.consumers.analytics.settings import AnalyticsSettings
from rollstream.consumers.errors import QueryError, RefusedQuery
from rollstream.consumers.store.chstore import connect, insert_batch, query
from rollstream.consumers.store.migrations import apply_migrations
from rollstream.consumers.store.rows import RowBatch
from rollstream.schemas import Event, RolloutFinished, RolloutStarted

pytestmark = pytest.mark.integration

KEY = "analyst-key-1"
AUTH = {"Authorization": f"Bearer {KEY}"}
OURS, OTHER = "rollstream_lk1", "rollstream_lk2"
SECRET_TASK = "secret-task-of-lk2"
T0 = 1_735_689_600_000_000


def _rollouts(db_client: Any, database: str, task: str, n: int) -> None:
    batch = RowBatch("rollout.events", 0)
    for i in range(n):
        rid = f"{task}-r{i}"
        for seq, body in enumerate([RolloutStarted(task, "g"), RolloutFinished("completed")]):
            batch.add(Event(f"{rid}e{seq}", rid, seq, T0 + i, body), len(batch))
    insert_batch(db_client, batch.tables, batch.token, database=database)


@pytest.fixture(scope="module")
def chdb_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("chdb-lockdown")
    writer = connect(f"chdb://{path}")
    for database in (OURS, OTHER):
        apply_migrations(writer, database)
    _rollouts(writer, OURS, "task-a", 3)
    _rollouts(writer, OTHER, SECRET_TASK, 2)
    yield path
    writer.close()


@pytest.fixture(scope="module")
def server(chdb_path: Path) -> Iterator[AnalyticsServer]:
    settings = AnalyticsSettings(
        clickhouse_url=f"chdb://{chdb_path}",
        namespace="lk1",
        analytics_port=0,
        analytics_api_keys=f"{KEY},another-key",
        analytics_max_execution_time_s=2.0,
        analytics_max_result_rows=10_000,
        analytics_max_result_bytes=1024 * 1024,
        analytics_max_memory_bytes=64 * 1024 * 1024,
        analytics_max_body_bytes=64 * 1024,
    )
    assert settings.database == OURS
    srv = serve(settings)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server: AnalyticsServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


def _sql(http: httpx.Client, sql: str, **extra: Any) -> httpx.Response:
    return http.post("/query", json={"sql": sql, **extra})


# --- the key --------------------------------------------------------------------------------


def test_the_analyst_key_is_required(server: AnalyticsServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        calls: list[tuple[str, str, dict[str, Any]]] = [
            ("POST", "/query", {"json": {"sql": "SELECT 1"}}),
            ("GET", "/reports", {}),
            ("GET", "/reports/rollouts_by_status", {}),
            ("POST", "/events", {"json": {"filter": {}}}),
            ("POST", "/events/count", {"json": {"filter": {}}}),
        ]
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            for method, path, kwargs in calls:
                r = anon.request(method, path, headers=headers, **kwargs)
                assert r.status_code == 401, (path, headers, r.text)
                assert "API key" in r.json()["error"]
                assert r.headers["WWW-Authenticate"] == "Bearer"
        # health without a key: alive, and nothing more
        assert anon.get("/health").json() == {"service": "rollstream-analytics", "auth": "required"}
        for key in (KEY, "another-key"):
            r = anon.post(
                "/query", json={"sql": "SELECT 1"}, headers={"Authorization": f"Bearer {key}"}
            )
            assert r.status_code == 200 and r.json()["rows"] == [[1]]
        health = anon.get("/health", headers=AUTH).json()
        assert health["database"] == OURS and health["namespace"] == "lk1"


def test_a_server_without_keys_warns_loudly_at_start(
    chdb_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = AnalyticsSettings(
        clickhouse_url=f"chdb://{chdb_path}", namespace="lk1", analytics_port=0
    )
    with caplog.at_level(logging.WARNING, logger="rollstream.consumers.analytics.server"):
        open_server = serve(settings)
    try:
        assert any("no analytics_api_keys set" in r.getMessage() for r in caplog.records)
        assert httpx.post(f"{open_server.url}/query", json={"sql": "SELECT 1"}).status_code == 200
    finally:
        open_server.stop()


# --- every way out --------------------------------------------------------------------------

WAYS_OUT = {
    "scalar file": ("SELECT substring(file('/proc/self/environ'), 1, 200)", "file()"),
    "quoted scalar file": ("SELECT `file`('/proc/self/environ')", "file()"),
    "table file": ("SELECT * FROM file('/etc/hostname', 'LineAsString')", "file()"),
    "url": ("SELECT * FROM url('http://127.0.0.1:9/x', 'LineAsString')", "url()"),
    "s3": ("SELECT * FROM s3('http://127.0.0.1:9/b/x', 'CSV')", "s3()"),
    "remote": ("SELECT * FROM remote('127.0.0.1:9000', system.one)", "remote()"),
    "remoteSecure": ("SELECT * FROM remoteSecure('127.0.0.1:9440', 'd', 't')", "remoteSecure()"),
    "mysql": ("SELECT * FROM mysql('127.0.0.1:9', 'd', 't', 'u', 'p')", "mysql()"),
    "postgresql": ("SELECT * FROM postgresql('127.0.0.1:9', 'd', 't', 'u', 'p')", "postgresql()"),
    "hdfs": ("SELECT * FROM hdfs('hdfs://127.0.0.1:9/x', 'TSV', 'a String')", "hdfs()"),
    "azureBlobStorage": (
        "SELECT * FROM azureBlobStorage('DefaultEndpointsProtocol=http', 'c', 'b')",
        "azureBlobStorage()",
    ),
    "input": ("SELECT * FROM input('a String')", "input()"),
    "executable": ("SELECT * FROM executable('ls', 'TSV', 'x String')", "executable()"),
    "cluster": ("SELECT * FROM cluster('default', system.one)", "cluster()"),
    "dictionary": ("SELECT * FROM dictionary('d')", "dictionary()"),
    "dictGet": ("SELECT dictGet('d', 'x', toUInt64(1))", "dictGet()"),
    "merge over system": ("SELECT count() FROM merge('system', '^tables$')", "merge()"),
    "mergeTreeIndex": (f"SELECT * FROM mergeTreeIndex('{OTHER}', 'events')", "mergeTreeIndex()"),
    "hasColumnInTable": ("SELECT hasColumnInTable('system', 'tables', 'name')", "hasColumnInTable"),
    "getSetting": ("SELECT getSetting('readonly')", "getSetting()"),
    "system table": ("SELECT name FROM system.databases", "database system"),
    "information schema": ("SELECT * FROM INFORMATION_SCHEMA.tables", "INFORMATION_SCHEMA"),
    "other namespace": (f"SELECT task_id FROM {OTHER}.rollouts", f"database {OTHER}"),
    "IN another table": (f"SELECT 1 WHERE 'x' IN {OTHER}.rollouts", f"database {OTHER}"),
    "view over system": ("SELECT * FROM view(SELECT * FROM system.one)", "database system"),
    "describe system": ("DESCRIBE TABLE system.tables", "database system"),
    "exists system": ("EXISTS TABLE system.one", "database system"),
    "show databases": ("SHOW DATABASES", "SHOW TABLES only"),
    "show tables from": (f"SHOW TABLES FROM {OTHER}", "SHOW TABLES only"),
    "into outfile": ("SELECT 1 INTO OUTFILE '{outfile}'", "INTO OUTFILE"),
    "from infile": ("SELECT 1 FROM INFILE '/etc/hostname'", "INFILE"),
    "settings readonly=0": ("SELECT 1 SETTINGS readonly = 0", "SETTINGS"),
    "settings a limit": ("SELECT 1 SETTINGS max_execution_time = 100000", "SETTINGS"),
    "settings introspection": ("SELECT 1 SETTINGS allow_introspection_functions = 1", "SETTINGS"),
    "format": ("SELECT 1 FORMAT TSV", "FORMAT"),
    "heredoc smuggling": ("SELECT $$'$$, file('/etc/hostname'), $$'$$", "file()"),
    "a second statement": ("SELECT 1; SELECT file('/etc/hostname')", "one statement"),
    "write": ("INSERT INTO events SELECT * FROM events", "not INSERT"),
}


@pytest.mark.parametrize("case", list(WAYS_OUT))
def test_every_way_out_is_refused_with_its_reason(
    http: httpx.Client, case: str, tmp_path: Path
) -> None:
    sql, reason = WAYS_OUT[case]
    outfile = tmp_path / "out.txt"
    r = _sql(http, sql.format(outfile=outfile))
    assert r.status_code == 403, r.text
    assert reason in r.json()["error"]
    assert SECRET_TASK not in r.text and "PATH=" not in r.text and not outfile.exists()


def test_identifier_parameters_are_checked_as_the_engine_reads_them(http: httpx.Client) -> None:
    """``{t:Identifier}`` puts a name where our lexer sees only a placeholder: the check of the
    engine's parse (EXPLAIN AST with the same parameters) sees the table."""
    for sql, table in (
        ("SELECT * FROM {t:Identifier}", "system.one"),
        ("SELECT task_id FROM {t:Identifier}", f"{OTHER}.rollouts"),
        ("SELECT 1 WHERE 'x' IN {t:Identifier}", f"{OTHER}.rollouts"),
    ):
        r = _sql(http, sql, params={"t": table})
        assert r.status_code == 403 and "outside" in r.json()["error"], r.text
    ours = _sql(http, "SELECT count() FROM {t:Identifier}", params={"t": "events"})
    assert ours.json()["rows"] == [[6]]


def test_other_namespaces_are_refused_on_every_route(http: httpx.Client) -> None:
    for ns in ("lk2", ""):
        r = http.get("/reports/rollouts_by_status", params={"namespace": ns})
        assert r.status_code == 403 and "serves namespace 'lk1'" in r.json()["error"]
        for path in ("/events", "/events/count"):
            r = http.post(path, json={"namespace": ns, "filter": {}})
            assert r.status_code == 403, (path, r.text)
    # its own namespace, named or not
    assert http.post("/events/count", json={"namespace": "lk1", "filter": {}}).json() == {
        "rollouts": 3,
        "events": 6,
    }
    r = http.get("/reports/rollouts_by_status", params={"namespace": "lk1"})
    assert r.json()["rows"] == [["completed", 3, 1.0]]


def test_the_namespaces_own_data_and_every_canned_view_pass_the_whole_gate(
    http: httpx.Client,
) -> None:
    rows = _sql(http, "SELECT task_id, count() FROM rollout_status GROUP BY task_id").json()
    assert rows["rows"] == [["task-a", 3]]
    assert _sql(http, f"SELECT count() FROM {OURS}.events").json()["rows"] == [[6]]
    tables = [r[0] for r in _sql(http, "SHOW TABLES").json()["rows"]]
    assert "events" in tables and "rollouts" in tables
    for sql in ("DESCRIBE TABLE events", "EXISTS TABLE events", "EXPLAIN SELECT 1"):
        assert _sql(http, sql).status_code == 200, sql
    for name, view in reports.VIEWS.items():
        params = {k: p.default for k, p in view.params.items()}
        r = _sql(http, reports.render_sql(name, OURS), params=params)
        assert r.status_code == 200, (name, r.text)


# --- limits ---------------------------------------------------------------------------------


def test_time_memory_rows_and_bytes_are_limited_per_query(http: httpx.Client) -> None:
    limits = {
        "SELECT count() FROM numbers(100000000000) WHERE sipHash64(number) = 0": "TIMEOUT_EXCEEDED",
        "SELECT length(groupArray(number)) FROM numbers(100000000)": "MEMORY_LIMIT_EXCEEDED",
        "SELECT number FROM numbers(20000)": "max rows",
        "SELECT randomString(10000) FROM numbers(500)": "max bytes",
    }
    for sql, reason in limits.items():
        r = _sql(http, sql)
        assert r.status_code == 400 and reason in r.json()["error"], (sql, r.text)
    assert _sql(http, "SELECT 1").json()["rows"] == [[1]]  # the client still answers


def test_request_bodies_are_limited(http: httpx.Client) -> None:
    big = {"sql": "SELECT '" + "x" * 70_000 + "'"}
    r = http.post("/query", json=big)
    assert r.status_code == 413 and "65536 bytes" in r.json()["error"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams in
        yield b'{"sql": "SELECT 1", "pad": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}'

    r = http.post("/query", content=chunks())
    assert r.status_code == 413


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[1, 2]",
        b'{"sql": 1}',
        b'{"sql": "SELECT {p:String}", "params": [1]}',
        b'{"sql": "SELECT {p:String}", "params": {"p x": 1}}',
        b'{"sql": "SELECT {p:String}", "params": {"p": {"a": 1}}}',
        b'{"sql": "SELECT {p:String}"}',
        b'{"sql": "SELECT nonsense("}',
        b'{"sql": "SELECT no_such_column FROM events"}',
        b"{\"sql\": \"SELECT toIPv4('1.2.3.4'), toUUID('00000000-0000-0000-0000-000000000000'), "
        b"map('a', 1), toDecimal64(1.5, 2), now64(6), [(1, 'x')]\"}",
    ],
)
def test_bad_requests_are_4xx_never_500(http: httpx.Client, body: bytes) -> None:
    r = http.post("/query", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert r.json()["error"]


def test_bad_view_and_event_requests_are_4xx(http: httpx.Client) -> None:
    assert http.get("/reports/nope").status_code == 404
    assert http.get("/reports/pass_at_k", params={"k": "many"}).status_code == 400
    assert http.get("/reports/pass_at_k", params={"bogus": "1"}).status_code == 400
    assert http.post("/events", json={"filter": {"since": "never"}}).status_code == 400
    assert http.post("/events", json={"filter": {}, "limit": 0}).status_code == 400


# --- the engine alone -----------------------------------------------------------------------


def test_the_engine_session_holds_without_our_checks(chdb_path: Path) -> None:
    """What chDB honours of ``readonly_settings`` when a query skips both checks."""
    client = connect(
        f"chdb://{chdb_path}",
        settings=readonly_settings(2.0, 1000, 64 * 1024 * 1024, max_result_bytes=1024 * 1024),
    )
    try:
        refused = {
            "SELECT * FROM file('/etc/hostname', 'LineAsString')": "READONLY",
            "SELECT * FROM url('http://127.0.0.1:9/x', 'LineAsString')": "READONLY",
            "SELECT * FROM executable('ls', 'TSV', 'x String')": "READONLY",
            "SELECT * FROM remote('127.0.0.1:9000', system.one)": "READONLY",
            "SELECT 1 SETTINGS readonly = 0": "READONLY",
            "SELECT 1 SETTINGS max_memory_usage = 0": "READONLY",
            "SELECT 1 SETTINGS allow_introspection_functions = 1": "READONLY",
            f"CREATE TABLE {OURS}.x (a UInt8) ENGINE = Memory": "READONLY",
            f"INSERT INTO {OURS}.events SELECT * FROM {OURS}.events": "READONLY",
            "SELECT addressToSymbol(1)": "allow_introspection_functions",
            "SELECT length(groupArray(number)) FROM numbers(100000000)": "MEMORY_LIMIT_EXCEEDED",
            "SELECT number FROM numbers(5000)": "max rows",
            "SELECT randomString(10000) FROM numbers(500)": "max bytes",
        }
        for sql, reason in refused.items():
            with pytest.raises(QueryError, match=reason):
                query(client, sql)
        # ... which is why the scalar file() and the other databases need our checks
        assert "PATH=" in query(client, "SELECT file('/proc/self/environ')").rows[0][0]
        assert query(client, "SELECT count() FROM system.one").rows == [(1,)]
    finally:
        client.close()


# --- our lexer against the engine's parser --------------------------------------------------

_PIECES = ["'", '"', "`", "$$", "$a$", "/*", "*/", "--", "# ", "\n", "\\", ",", " ", "x", "1"]


@pytest.fixture(scope="module")
def explain_client(chdb_path: Path) -> Iterator[Any]:
    client = connect(f"chdb://{chdb_path}", settings=readonly_settings(2.0, 1000))
    yield client
    client.close()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    before=st.lists(st.sampled_from(_PIECES), max_size=8),
    after=st.lists(st.sampled_from(_PIECES), max_size=8),
)
def test_what_the_lexer_accepts_calls_no_file_in_the_engines_parse(
    explain_client: Any, before: list[str], after: list[str]
) -> None:
    """However quotes, heredocs and comments are arranged around ``file(...)``, when our lexer
    accepts the statement the engine's own parse of it calls no file()."""
    sql = f"SELECT 1 {''.join(before)} , file('/etc/hostname') {''.join(after)}"
    try:
        statement = check_read_only(sql, database=OURS)
    except RefusedQuery:
        return
    try:
        plan = query(explain_client, f"EXPLAIN AST {statement}")
    except QueryError:
        return  # the engine cannot parse it: nothing runs
    assert not any(row[0].lstrip().startswith("Function file") for row in plan.rows), sql
