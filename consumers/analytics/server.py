"""The analytics server: the HTTP API of protocol.py over the store, served by the process that
owns it (``rollstream sink``: service.py runs it beside the sink loop).

chDB admits one process per data path, so whoever wants to read the sink's tables while it runs
(``rollstream report``, ``rollstream replay --source clickhouse``, a notebook: client.py) asks
the sink's process: a small Starlette app run by uvicorn in a thread next to the consume loop,
on its own read-only ClickHouse client (a second client on the same path; clients do not share
settings), whose session runs with ``readonly.readonly_settings`` (time, memory and result
limits, then readonly=1). Queries are serialized on the one client.

Locked down (readonly.py has the rules):
- an analyst key (``analytics_api_keys``, ``Authorization: Bearer KEY``) on every route but a
  bare ``GET /health`` when keys are set (401 otherwise); none set: open, and ``serve`` warns;
- request bodies over ``analytics_max_body_bytes`` get 413;
- only the namespace's database: ``namespace`` in a request must be the server's (403);
- ``POST /query``: ``readonly.check_read_only(sql, database=)`` (our lexer), then the engine's
  own parse (``EXPLAIN AST``, not run) through ``readonly.check_ast``, then the query;
  ``params`` are ``{name: scalar or list}`` bound server-side.
A refused query is 403 naming the reason; a query the engine refuses or that breaks a limit is
400 with the engine's message; neither ever 500.

    create_app(store, database=, namespace=, stats=, lag=, codec=, api_keys=, max_body_bytes=)
    serve(settings, stats=) -> AnalyticsServer      the app in a daemon thread (``stop()``)

The web UI (``ui/``: static files, open) is served at ``/ui/``; its data comes from the canned
views and ``/ui/api/<name>`` (ui_api.py), behind the same key; ``/ui/api/lag`` is the consumer
lag of the namespace's groups, read from Kafka (``LagProbe``: at most every 5 s, each broker call
bounded to 3 s; a broker that does not answer gives ``{"groups": [], "error": ...}``).

Errors: ``AnalyticsError`` (the server did not start); requests that fail answer 400
(bad request, a query ClickHouse refused), 401 (no valid key), 403 (RefusedQuery), 404 (no
such view) or 413 (body too large).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import orjson
import uvicorn
from confluent_kafka import KafkaException
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from rollstream.adapters.auth import bearer_token, key_matches
from rollstream.adapters.codecs import build_codec
from rollstream.adapters.topics import TopicError, namespace_lag
from rollstream.consumers.analytics import reports, ui_api
from rollstream.consumers.analytics.openapi import openapi
from rollstream.consumers.analytics.protocol import (
    LAST_HEADER,
    RECORDS_HEADER,
    SERVICE,
    encode_frames,
)
from rollstream.consumers.analytics.readonly import check_ast, check_read_only, readonly_settings
from rollstream.consumers.analytics.settings import AnalyticsSettings
from rollstream.consumers.errors import (
    AnalyticsError,
    AnalyticsHTTPError,
    RefusedQuery,
    StoreError,
)
from rollstream.consumers.store import chstore
from rollstream.consumers.store.chstore import Table
from rollstream.consumers.store.queries import RolloutFilter, count_rollouts, rollout_page
from rollstream.schemas import Codec, CommonSettings

__all__ = [
    "AnalyticsError",
    "AnalyticsHTTPError",
    "AnalyticsServer",
    "QueryClient",
    "RefusedQuery",
    "checked_query",
    "create_app",
    "serve",
    "ui_data",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1024 * 1024
UI_DIR = Path(__file__).parent / "ui"  # the web UI's static files, served at /ui/
_PARAM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_PARAM_TYPES = (str, int, float, bool, list, type(None))


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return value.decode(errors="replace")
    return str(value)


def _json(data: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    body = orjson.dumps(
        data, default=_json_default, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
    )
    return Response(body, status, headers=dict(headers or {}), media_type="application/json")


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> Response:
    return JSONResponse({"error": message}, status, headers=dict(headers or {}))


class _Answer(AnalyticsError):
    """A request answered with an error status (inside the app only)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _coerce(view: reports.View, raw: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in raw.items():
        param = view.params.get(name)
        if param is None:
            raise ValueError(f"view {view.name} takes {sorted(view.params)}, not {name!r}")
        kind = param.type.lower()
        out[name] = float(value) if "float" in kind else int(value) if "int" in kind else value
    return out


def _params(raw: Any) -> dict[str, Any]:
    """A query's server-side parameters: ``{name: str | int | float | bool | list | null}``."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise AnalyticsError("params must be a JSON object")
    for name, value in raw.items():
        if not _PARAM_NAME.match(name):
            raise AnalyticsError(f"parameter name {name!r} is not an identifier")
        if not isinstance(value, _PARAM_TYPES):
            raise AnalyticsError(f"parameter {name} must be a scalar or a list")
    return dict(raw)


def checked_query(client: Any, sql: str, params: Mapping[str, Any], database: str) -> Table:
    """Run ``sql`` (already through ``check_read_only``) once the engine's own parse of it
    (``EXPLAIN AST``, which does not run it) passed ``check_ast``."""
    plan = chstore.query(client, f"EXPLAIN AST {sql}", params)
    check_ast([str(row[0]) for row in plan.rows], database=database)
    return chstore.query(client, sql, params)


def ui_data(client: Any, endpoint: ui_api.Endpoint, params: Any, database: str) -> Any:
    """Run a web UI data endpoint (ui_api.py) with ``client`` as its query edge."""
    return endpoint.run(params, database, lambda q: chstore.query(client, q.sql, q.params))


class QueryClient:
    """The read-only ClickHouse client behind the app. Calls are serialized; after a failed
    call the client is reopened (a query that fails mid-stream, e.g. over max_result_rows,
    leaves unread data on a chDB handle that the next query would read); a refused query
    never reached the engine's result stream and leaves the client as it was."""

    def __init__(self, connect: Callable[[], Any]) -> None:
        self._connect = connect
        self._lock = threading.Lock()
        self._client = connect()

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            try:
                return fn(self._client, *args, **kwargs)
            except RefusedQuery:
                raise
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


class LagProbe:
    """The consumer lag of the namespace's groups (adapters.topics.namespace_lag), read from
    Kafka at most every ``ttl`` s; callers in between get the last answer."""

    def __init__(self, settings: CommonSettings, *, ttl: float = 5.0, timeout: float = 3.0):
        self.settings, self.ttl, self.timeout = settings, ttl, timeout
        self._lock = threading.Lock()
        self._at = -float("inf")
        self._answer: dict[str, Any] = {}

    def __call__(self) -> dict[str, Any]:
        with self._lock:
            if time.monotonic() - self._at < self.ttl:
                return self._answer
            try:
                rows = namespace_lag(self.settings, self.timeout)
                groups = [{"group": r.group, "topic": r.topic, "partitions": r.partitions,
                           "lag": r.lag} for r in rows]  # fmt: skip
                self._answer = {"groups": groups, "error": None, "read_at": time.time()}
            except (TopicError, KafkaException) as exc:
                self._answer = {"groups": [], "error": str(exc)[:500], "read_at": time.time()}
            self._at = time.monotonic()
            return self._answer


def create_app(
    store: QueryClient,
    *,
    database: str,
    namespace: str = "",
    stats: Callable[[], dict[str, Any]] | None = None,
    lag: Callable[[], dict[str, Any]] | None = None,
    codec: Codec,
    api_keys: Sequence[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> Starlette:
    """The analytics app over a read-only ``store`` (see ``readonly_settings``); ``codec``
    encodes the events ``POST /events`` sends; ``stats`` are the sink's counters; with
    ``api_keys`` every route but a bare ``/health`` wants one of them as a bearer token."""
    keys = [k.encode() for k in api_keys if k]

    def authorized(request: Request) -> bool:
        if not keys:
            return True
        return key_matches(bearer_token(request.headers.get("authorization")), keys)

    Handler = Callable[[Request], Awaitable[Response]]

    def endpoint(handler: Handler) -> Handler:
        """Key check, then the handler; its refusals become 4xx answers naming the reason."""

        async def answer(request: Request) -> Response:
            if not authorized(request):
                return _error(
                    401,
                    "missing or invalid analyst API key (Authorization: Bearer KEY)",
                    {"WWW-Authenticate": "Bearer"},
                )
            try:
                return await handler(request)
            except _Answer as exc:
                return _error(exc.status, str(exc))
            except RefusedQuery as exc:
                return _error(403, str(exc))
            except (AnalyticsError, StoreError, ValueError, TypeError) as exc:
                return _error(400, str(exc))

        return answer

    def database_of(ns: Any) -> str:
        if ns is None or str(ns) == namespace or chstore.database_for(str(ns)) == database:
            return database
        raise RefusedQuery(f"this server serves namespace {namespace!r} (database {database}) only")

    async def body_of(request: Request) -> dict[str, Any]:
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > max_body_bytes):
            raise _Answer(413, f"the request body is over {max_body_bytes} bytes")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise _Answer(413, f"the request body is over {max_body_bytes} bytes")
            chunks.append(chunk)
        try:
            data = orjson.loads(b"".join(chunks))
        except orjson.JSONDecodeError as exc:
            raise AnalyticsError(f"body is not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise AnalyticsError("body must be a JSON object")
        return data

    async def health(request: Request) -> Response:
        if not authorized(request):  # liveness only: no names, no counters
            return _json({"service": SERVICE, "auth": "required"})
        return _json(
            {
                "service": SERVICE,
                "database": database,
                "namespace": namespace,
                "sink": stats() if stats else None,
            }
        )

    async def run_query(request: Request) -> Response:
        data = await body_of(request)
        sql = data.get("sql")
        if not isinstance(sql, str):
            raise AnalyticsError("sql must be a string")
        statement = check_read_only(sql, database=database)
        params = _params(data.get("params"))
        try:
            table = await run_in_threadpool(store.call, checked_query, statement, params, database)
        except (RefusedQuery, StoreError):
            raise
        except Exception as exc:  # the driver could not read the engine's answer
            log.warning("query answer unreadable: %s", exc, exc_info=True)
            raise AnalyticsError(
                f"the answer could not be read: {type(exc).__name__}: {exc}"
            ) from exc
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
            raise _Answer(404, f"no view {name!r}; views: {', '.join(reports.VIEWS)}")
        raw = dict(request.query_params)
        db = database_of(raw.pop("namespace", None))
        params = _coerce(view, raw)
        table = await run_in_threadpool(store.call, reports.run_report, name, database=db, **params)
        return _json(
            {"view": name, "title": view.title, "columns": table.columns, "rows": table.rows}
        )

    def selection(data: dict[str, Any]) -> tuple[str, RolloutFilter]:
        return database_of(data.get("namespace")), RolloutFilter.from_json(data.get("filter"))

    async def events(request: Request) -> Response:
        data = await body_of(request)
        db, flt = selection(data)
        after = data.get("after")
        limit = int(data.get("limit", 500))
        records, last = await run_in_threadpool(
            store.call, rollout_page, db, flt, after, limit, codec
        )
        return Response(
            encode_frames(records),
            media_type="application/octet-stream",
            headers={
                LAST_HEADER: quote(last or "", safe=""),
                RECORDS_HEADER: str(len(records)),
            },
        )

    async def count(request: Request) -> Response:
        db, flt = selection(await body_of(request))
        rollouts, n_events = await run_in_threadpool(store.call, count_rollouts, db, flt)
        return _json({"rollouts": rollouts, "events": n_events})

    async def ui_endpoint(request: Request) -> Response:
        name = request.path_params["name"]
        spec = ui_api.ENDPOINTS.get(name)
        if spec is None:
            raise _Answer(404, f"no UI endpoint {name!r}; endpoints: {', '.join(ui_api.ENDPOINTS)}")
        raw = request.query_params.multi_items()
        db = database_of(next((v for k, v in raw if k == "namespace"), None))
        params = ui_api.parse_params(spec, [(k, v) for k, v in raw if k != "namespace"])
        return _json(await run_in_threadpool(store.call, ui_data, spec, params, db))

    async def lag_endpoint(request: Request) -> Response:
        database_of(request.query_params.get("namespace"))
        if lag is None:
            return _json({"groups": [], "error": "this server reads no Kafka", "read_at": None})
        return _json(await run_in_threadpool(lag))

    views = {v.name: {k: p.type for k, p in v.params.items()} for v in reports.VIEWS.values()}
    document = openapi(views)

    async def openapi_json(request: Request) -> Response:
        return _json(document)

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/openapi.json", openapi_json),  # open, as /health: no data
            Route("/query", endpoint(run_query), methods=["POST"]),
            Route("/reports", endpoint(list_views)),
            Route("/reports/{view}", endpoint(run_view)),
            Route("/events", endpoint(events), methods=["POST"]),
            Route("/events/count", endpoint(count), methods=["POST"]),
            Route("/ui/api/lag", endpoint(lag_endpoint)),
            Route("/ui/api/{name}", endpoint(ui_endpoint)),
            Mount("/ui", StaticFiles(directory=UI_DIR, html=True), name="ui"),  # open: no data
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
                s.analytics_max_execution_time_s,
                s.analytics_max_result_rows,
                s.analytics_max_memory_bytes,
                max_result_bytes=s.analytics_max_result_bytes,
            ),
        )
        client.database = s.database  # unqualified table names are the namespace's tables
        return client

    keys = [k.get_secret_value() for k in s.analytics_api_keys]
    store = QueryClient(connect)
    app = create_app(
        store,
        database=s.database,
        namespace=s.namespace,
        stats=stats,
        lag=LagProbe(s),
        codec=build_codec(s),
        api_keys=keys,
        max_body_bytes=s.analytics_max_body_bytes,
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
    if not any(keys):
        log.warning(
            "!!! no analytics_api_keys set: the analytics server on %s:%d answers anyone who "
            "can reach it (set ROLLSTREAM_ANALYTICS_API_KEYS) !!!",
            s.analytics_host,
            port,
        )
    return AnalyticsServer(server, thread, store, s.analytics_host, port)
