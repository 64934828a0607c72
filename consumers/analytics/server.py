"""Analytics over HTTP, served by the process that owns the store (the sink), and its client.

chDB admits one process per data path, so whoever wants to read the sink's tables while it runs
(``rollstream report``, ``rollstream replay --source clickhouse``, a notebook) asks the sink's
process: a small Starlette app run by uvicorn in a thread next to the consume loop, on its own
read-only ClickHouse client (a second client on the same path; clients do not share settings).

    GET  /health                      {"service": "rollstream-analytics", database, namespace, sink}
    POST /query   {sql, params?}      {"columns": [...], "rows": [[...], ...]}   read-only
    GET  /reports                     the canned views (reports.VIEWS) and their parameters
    GET  /reports/{view}?namespace=&k=v   {"view", "title", "columns", "rows"}
    POST /events  {namespace, filter, after, limit}   a page of whole rollouts (replay.RolloutFilter
                                       as JSON), framed (4-byte big-endian length + bytes): key,
                                       then Codec value, per event, in (rollout_id, seq) order;
                                       header X-Rollstream-Last = the page's last rollout_id,
                                       percent-encoded ("" when the page is the last)
    POST /events/count {namespace, filter}            {"rollouts": n, "events": m}

Read-only is enforced twice: ``check_read_only`` admits one statement starting with SELECT,
WITH, SHOW, DESCRIBE/DESC, EXPLAIN or EXISTS (no INTO OUTFILE), and the query client's session
runs with ``readonly=1`` (no writes, no DDL, no table functions, no SETTINGS overrides) after
``max_execution_time``, ``max_result_rows`` (result_overflow_mode=throw) and optionally
``max_memory_usage`` were set. Queries are serialized on the one client.

Errors::

    AnalyticsError              root of the analytics API (client and server)
    ├── RefusedQuery            not a single read-only statement (HTTP 403)
    └── AnalyticsHTTPError      the server answered an error (``status``; client side)
"""

from __future__ import annotations

import contextlib
import itertools
import re
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

import httpx
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollstream.consumers.analytics import reports
from rollstream.consumers.store import chstore
from rollstream.consumers.store.chstore import StoreError, Table

if TYPE_CHECKING:
    from rollstream.consumers.store.sink import SinkSettings

__all__ = [
    "READ_KEYWORDS",
    "SERVICE",
    "AnalyticsClient",
    "AnalyticsError",
    "AnalyticsHTTPError",
    "AnalyticsServer",
    "QueryClient",
    "RefusedQuery",
    "check_read_only",
    "create_app",
    "decode_frames",
    "encode_frames",
    "readonly_settings",
    "serve",
]

SERVICE = "rollstream-analytics"
READ_KEYWORDS = frozenset({"SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXPLAIN", "EXISTS"})
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FRAME = struct.Struct(">I")


class AnalyticsError(Exception):
    """Root of the analytics API's errors."""


class RefusedQuery(AnalyticsError):
    """The statement is not one read-only query."""


class AnalyticsHTTPError(AnalyticsError):
    """The analytics server answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"analytics server answered {status}: {message}")
        self.status = status


# --- read-only gate (pure) ------------------------------------------------------------------


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
    """Session settings of the query client, limits first: once ``readonly=1`` is set nothing
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


# --- frames ----------------------------------------------------------------------------------


def encode_frames(records: list[bytes]) -> bytes:
    return b"".join(_FRAME.pack(len(r)) + r for r in records)


def decode_frames(data: bytes) -> list[bytes]:
    out: list[bytes] = []
    view = memoryview(data)
    i = 0
    while i < len(view):
        if i + 4 > len(view):
            raise AnalyticsError("truncated frame header")
        (size,) = _FRAME.unpack_from(view, i)
        i += 4
        if i + size > len(view):
            raise AnalyticsError("truncated frame")
        out.append(bytes(view[i : i + size]))
        i += size
    return out


# --- server -----------------------------------------------------------------------------------


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return value.decode(errors="replace")
    return str(value)


def _json(data: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    body = orjson.dumps(
        data, default=_json_default, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
    )
    return Response(body, status, headers=dict(headers or {}), media_type="application/json")


def _error(status: int, message: str) -> Response:
    return JSONResponse({"error": message}, status)


def _coerce(view: reports.View, raw: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in raw.items():
        param = view.params.get(name)
        if param is None:
            raise ValueError(f"view {view.name} takes {sorted(view.params)}, not {name!r}")
        kind = param.type.lower()
        out[name] = float(value) if "float" in kind else int(value) if "int" in kind else value
    return out


class QueryClient:
    """The read-only ClickHouse client behind the app. Calls are serialized; after a failed
    call the client is reopened (a query that fails mid-stream, e.g. over max_result_rows,
    leaves unread data on a chDB handle that the next query would read)."""

    def __init__(self, connect: Callable[[], Any]) -> None:
        self._connect = connect
        self._lock = threading.Lock()
        self._client = connect()

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            try:
                return fn(self._client, *args, **kwargs)
            except Exception:
                self._reopen()
                raise

    def _reopen(self) -> None:
        with contextlib.suppress(Exception):
            self._client.close()
        self._client = self._connect()

    def close(self) -> None:
        with self._lock:
            self._client.close()


def create_app(
    store: QueryClient,
    *,
    database: str,
    namespace: str = "",
    stats: Callable[[], dict[str, Any]] | None = None,
) -> Starlette:
    """The analytics app over a read-only ``store`` (see ``readonly_settings``)."""
    from rollstream.consumers.analytics.replay import (  # replay imports us
        RolloutFilter,
        count_rollouts,
        rollout_page,
    )

    def database_of(ns: Any) -> str:
        return database if ns is None else chstore.database_for(str(ns))

    async def health(request: Request) -> Response:
        return _json(
            {
                "service": SERVICE,
                "database": database,
                "namespace": namespace,
                "sink": stats() if stats else None,
            }
        )

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            data = await request.json()
        except ValueError as exc:
            raise AnalyticsError(f"body is not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise AnalyticsError("body must be a JSON object")
        return data

    async def run_query(request: Request) -> Response:
        try:
            data = await body_of(request)
            sql = check_read_only(str(data.get("sql", "")))
        except RefusedQuery as exc:
            return _error(403, str(exc))
        except AnalyticsError as exc:
            return _error(400, str(exc))
        try:
            table = await run_in_threadpool(
                store.call, chstore.query, sql, data.get("params") or {}
            )
        except StoreError as exc:
            return _error(400, str(exc))
        return _json({"columns": table.columns, "rows": table.rows})

    async def list_views(request: Request) -> Response:
        return _json(
            [
                {"name": v.name, "title": v.title, "chart": v.chart,
                 "params": {k: {"type": p.type, "default": p.default} for k, p in v.params.items()}}
                for v in reports.VIEWS.values()
            ]
        )  # fmt: skip

    async def run_view(request: Request) -> Response:
        name = request.path_params["view"]
        view = reports.VIEWS.get(name)
        if view is None:
            return _error(404, f"no view {name!r}; views: {', '.join(reports.VIEWS)}")
        raw = dict(request.query_params)
        try:
            db = database_of(raw.pop("namespace", None))
            params = _coerce(view, raw)
        except (ValueError, StoreError) as exc:
            return _error(400, str(exc))
        try:
            table = await run_in_threadpool(
                store.call, reports.run_report, name, database=db, **params
            )
        except StoreError as exc:
            return _error(400, str(exc))
        return _json(
            {"view": name, "title": view.title, "columns": table.columns, "rows": table.rows}
        )

    def selection(data: dict[str, Any]) -> tuple[str, RolloutFilter]:
        return database_of(data.get("namespace")), RolloutFilter.from_json(data.get("filter"))

    async def events(request: Request) -> Response:
        try:
            data = await body_of(request)
            db, flt = selection(data)
            after = data.get("after")
            limit = int(data.get("limit", 500))
        except (AnalyticsError, ValueError, TypeError, StoreError) as exc:
            return _error(400, str(exc))
        try:
            records, last = await run_in_threadpool(store.call, rollout_page, db, flt, after, limit)
        except StoreError as exc:
            return _error(400, str(exc))
        return Response(
            encode_frames(records),
            media_type="application/octet-stream",
            headers={
                "X-Rollstream-Last": quote(last or "", safe=""),
                "X-Rollstream-Records": str(len(records)),
            },
        )

    async def count(request: Request) -> Response:
        try:
            db, flt = selection(await body_of(request))
        except (AnalyticsError, ValueError, TypeError, StoreError) as exc:
            return _error(400, str(exc))
        try:
            rollouts, n_events = await run_in_threadpool(store.call, count_rollouts, db, flt)
        except StoreError as exc:
            return _error(400, str(exc))
        return _json({"rollouts": rollouts, "events": n_events})

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/query", run_query, methods=["POST"]),
            Route("/reports", list_views),
            Route("/reports/{view}", run_view),
            Route("/events", events, methods=["POST"]),
            Route("/events/count", count, methods=["POST"]),
        ]
    )


@dataclass
class AnalyticsServer:
    """A uvicorn server running in a daemon thread."""

    server: uvicorn.Server
    thread: threading.Thread
    store: QueryClient
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.store.close()


def serve(
    settings: SinkSettings, *, stats: Callable[[], dict[str, Any]] | None = None
) -> AnalyticsServer:
    """Open a read-only client on the sink's store and serve the app in a thread of this
    process (call after the sink has applied its migrations)."""
    s = settings

    def connect() -> Any:
        client = chstore.connect(
            s.clickhouse_url,
            settings=readonly_settings(
                s.analytics_max_execution_time_s, s.analytics_max_result_rows,
                s.analytics_max_memory_bytes,
            ),
        )  # fmt: skip
        client.database = s.database  # unqualified table names are the sink's tables
        return client

    store = QueryClient(connect)
    app = create_app(store, database=s.database, namespace=s.namespace, stats=stats)
    config = uvicorn.Config(
        app, host=s.analytics_host, port=s.analytics_port, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="analytics-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            store.close()
            raise AnalyticsError(
                f"analytics server did not start on {s.analytics_host}:{s.analytics_port}"
            )
        time.sleep(0.02)
    port = s.analytics_port or server.servers[0].sockets[0].getsockname()[1]
    return AnalyticsServer(server, thread, store, s.analytics_host, port)


# --- client ------------------------------------------------------------------------------------


def _table(columns: list[str], rows: list[list[Any]]) -> Table:
    """JSON rows back to a Table; null in a float column is NaN (JSON has no NaN)."""
    floats = [
        any(isinstance(r[i], float) for r in rows)
        and all(r[i] is None or isinstance(r[i], float | int) for r in rows)
        for i in range(len(columns))
    ]
    fixed = [
        tuple(float("nan") if v is None and floats[i] else v for i, v in enumerate(r)) for r in rows
    ]
    return Table(tuple(columns), fixed)


class AnalyticsClient:
    """HTTP client of the analytics server (``rollstream report``, ``rollstream replay``)."""

    def __init__(self, url: str, *, timeout: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout)

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise AnalyticsError(f"cannot reach the analytics server at {self.url}: {exc}") from exc
        if response.status_code >= 400:
            try:
                message = response.json().get("error", response.text)
            except ValueError:
                message = response.text
            if response.status_code == 403:
                raise RefusedQuery(message)
            raise AnalyticsHTTPError(response.status_code, message)
        return response

    def health(self) -> dict[str, Any]:
        data = self._call("GET", "/health").json()
        if not isinstance(data, dict) or data.get("service") != SERVICE:
            raise AnalyticsError(f"{self.url} is not a rollstream analytics server")
        return data

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> Table:
        data = self._call("POST", "/query", json={"sql": sql, "params": dict(params or {})}).json()
        return _table(data["columns"], data["rows"])

    def views(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/reports").json())

    def report(self, view: str, *, namespace: str | None = None, **params: Any) -> Table:
        query = {k: str(v) for k, v in params.items()}
        if namespace is not None:
            query["namespace"] = namespace
        data = self._call("GET", f"/reports/{view}", params=query).json()
        return _table(data["columns"], data["rows"])

    def event_page(
        self, namespace: str | None, filter_json: dict[str, Any], after: str | None, limit: int
    ) -> tuple[list[bytes], str | None]:
        """One page of encoded events (whole rollouts) and the cursor for the next page."""
        body = {"namespace": namespace, "filter": filter_json, "after": after, "limit": limit}
        response = self._call("POST", "/events", json=body)
        last = unquote(response.headers.get("X-Rollstream-Last", ""))
        return decode_frames(response.content), last or None

    def events(
        self, namespace: str | None, filter_json: dict[str, Any], *, page_rollouts: int = 500
    ) -> Iterator[list[bytes]]:
        after: str | None = None
        while True:
            records, after = self.event_page(namespace, filter_json, after, page_rollouts)
            if records:
                yield records
            if after is None:
                return

    def count(self, namespace: str | None, filter_json: dict[str, Any]) -> tuple[int, int]:
        data = self._call(
            "POST", "/events/count", json={"namespace": namespace, "filter": filter_json}
        ).json()
        return int(data["rollouts"]), int(data["events"])

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AnalyticsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
