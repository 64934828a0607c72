"""The analytics server: the HTTP API of protocol.py over the store, served by the process that
owns it (``rollstream sink``: service.py runs it beside the sink loop).

chDB admits one process per data path, so whoever wants to read the sink's tables while it runs
(``rollstream report``, ``rollstream replay --source clickhouse``, a notebook: client.py) asks
the sink's process: a small Starlette app run by uvicorn in a thread next to the consume loop,
on its own read-only ClickHouse client (a second client on the same path; clients do not share
settings), whose session runs with ``readonly.readonly_settings``; every ad-hoc statement passes
``readonly.check_read_only`` first. Queries are serialized on the one client.

    create_app(store, database=, namespace=, stats=, codec=) -> Starlette
    serve(settings, stats=) -> AnalyticsServer      the app in a daemon thread (``stop()``)

Errors: ``AnalyticsError`` (the server did not start); requests that fail answer 400
(bad request, a query ClickHouse refused), 403 (RefusedQuery) or 404 (no such view).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollstream.adapters.codecs import build_codec
from rollstream.consumers.analytics import reports
from rollstream.consumers.analytics.protocol import (
    LAST_HEADER,
    RECORDS_HEADER,
    SERVICE,
    encode_frames,
)
from rollstream.consumers.analytics.readonly import check_read_only, readonly_settings
from rollstream.consumers.analytics.settings import AnalyticsSettings
from rollstream.consumers.errors import (
    AnalyticsError,
    AnalyticsHTTPError,
    RefusedQuery,
    StoreError,
)
from rollstream.consumers.store import chstore
from rollstream.consumers.store.queries import RolloutFilter, count_rollouts, rollout_page
from rollstream.schemas import Codec

__all__ = [
    "AnalyticsError",
    "AnalyticsHTTPError",
    "AnalyticsServer",
    "QueryClient",
    "RefusedQuery",
    "create_app",
    "serve",
]


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
    codec: Codec,
) -> Starlette:
    """The analytics app over a read-only ``store`` (see ``readonly_settings``); ``codec``
    encodes the events ``POST /events`` sends; ``stats`` are the sink's counters."""

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
            records, last = await run_in_threadpool(
                store.call, rollout_page, db, flt, after, limit, codec
            )
        except StoreError as exc:
            return _error(400, str(exc))
        return Response(
            encode_frames(records),
            media_type="application/octet-stream",
            headers={
                LAST_HEADER: quote(last or "", safe=""),
                RECORDS_HEADER: str(len(records)),
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
    settings: AnalyticsSettings, *, stats: Callable[[], dict[str, Any]] | None = None
) -> AnalyticsServer:
    """Open a read-only client on the store and serve the app in a thread of this process
    (call after the store's migrations were applied: the sink applies them when it opens)."""
    s = settings

    def connect() -> Any:
        client = chstore.connect(
            s.clickhouse_url,
            settings=readonly_settings(
                s.analytics_max_execution_time_s, s.analytics_max_result_rows,
                s.analytics_max_memory_bytes,
            ),
        )  # fmt: skip
        client.database = s.database  # unqualified table names are the namespace's tables
        return client

    store = QueryClient(connect)
    app = create_app(
        store, database=s.database, namespace=s.namespace, stats=stats, codec=build_codec(s)
    )
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
