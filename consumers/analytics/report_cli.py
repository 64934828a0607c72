"""``rollstream report``: the canned views (reports.VIEWS) and ad-hoc read-only SQL, rendered as
rich tables, and a view's chart as a PNG (``--plot FILE.png``).

    ReportSettings(CommonSettings)      ROLLSTREAM_ANALYTICS_URL, ROLLSTREAM_ANALYTICS_API_KEY,
                                        ROLLSTREAM_REPORT_*
    run(settings, *, view=None, sql=None, plot=None, url=None, params=None, console=None)
        -> dict[str, Table]             what was shown, by view name ("sql" for --sql)

Where the data comes from (``url``, else ``settings.analytics_url``):
- ``http(s)://`` answering ``GET /health`` as the rollstream analytics server: the server of a
  running sink (the process that holds the chDB path), sent ``analytics_api_key`` as
  ``Authorization: Bearer`` when it is set (a server with analyst keys answers 401 without);
- any other ``http(s)://`` URL: a ClickHouse server, queried directly by clickhouse-connect with
  the same read-only session settings the analytics server uses;
- ``chdb://PATH``: the chDB store itself (only while no sink holds the path).
With neither ``view`` nor ``sql``, every view is shown. SQL is checked by
``readonly.check_read_only`` on every path, and ClickHouse's readonly=1 refuses writes.

Errors (rollstream.consumers.errors): ``ReportError`` (unknown view, a plot of a view without a
chart); the analytics API's ``AnalyticsError`` tree (``RefusedQuery`` for a write) and the
store's ``StoreError`` pass through.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import SecretStr
from rich.console import Console
from rich.table import Table as RichTable

from rollstream.consumers.analytics import reports
from rollstream.consumers.analytics.client import AnalyticsClient
from rollstream.consumers.analytics.readonly import check_read_only, readonly_settings
from rollstream.consumers.errors import AnalyticsError, ReportError
from rollstream.consumers.store import chstore
from rollstream.consumers.store.chstore import Table
from rollstream.schemas import CommonSettings

__all__ = ["ReportError", "ReportSettings", "render", "run"]


class ReportSettings(CommonSettings):
    """``rollstream report``. ``namespace`` picks the database (chstore.database_for)."""

    analytics_url: str = "http://127.0.0.1:8300"  # a sink's analytics server or ClickHouse URL
    analytics_api_key: SecretStr | None = None  # analyst key of the analytics server (Bearer)
    report_max_execution_time_s: float = 30.0  # per query, when querying ClickHouse directly
    report_max_result_rows: int = 100_000  # ... and its result limit
    report_max_rows_shown: int = 200  # rows printed per table
    report_timeout_s: float = 120.0  # HTTP timeout towards the analytics server


class _Source:
    """Views and SQL from the analytics server, or straight from ClickHouse."""

    def __init__(self, settings: ReportSettings, url: str) -> None:
        self.settings = settings
        self.database = chstore.database_for(settings.namespace)
        self.remote: AnalyticsClient | None = None
        self.client: Any = None
        if url.startswith(("http://", "https://")):
            remote = AnalyticsClient(
                url, timeout=settings.report_timeout_s, api_key=settings.analytics_api_key
            )
            try:
                remote.health()
                self.remote = remote
            except AnalyticsError:
                remote.close()  # not our server: a ClickHouse server URL
        if self.remote is None:
            self.client = chstore.connect(
                url,
                settings=readonly_settings(
                    settings.report_max_execution_time_s, settings.report_max_result_rows
                ),
            )
        parts = urlsplit(url)
        self.where = (
            f"{parts.scheme}://{parts.hostname or ''}{parts.path}" if parts.hostname else url
        )

    def view(self, name: str, params: dict[str, Any]) -> Table:
        if self.remote is not None:
            return self.remote.report(name, namespace=self.settings.namespace, **params)
        return reports.run_report(self.client, name, database=self.database, **params)

    def sql(self, sql: str, params: dict[str, Any]) -> Table:
        statement = check_read_only(sql)
        if self.remote is not None:
            return self.remote.query(statement, params)
        return chstore.query(self.client, statement, params)

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        if self.client is not None:
            self.client.close()


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.4g}"
    if isinstance(value, list | tuple):
        text = ", ".join(_cell(v) for v in value[:8])
        return f"[{text}{', ...' if len(value) > 8 else ''}]"
    return str(value)


def render(table: Table, title: str, *, max_rows: int = 200) -> RichTable:
    """A rich table of a result (floats to 4 significant digits, NaN as '-')."""
    out = RichTable(*table.columns, title=title, title_justify="left")
    numeric = [
        any(isinstance(r[i], int | float) and not isinstance(r[i], bool) for r in table.rows)
        for i in range(len(table.columns))
    ]
    for i, column in enumerate(out.columns):
        if numeric[i]:
            column.justify = "right"
    for row in table.rows[:max_rows]:
        out.add_row(*(_cell(v) for v in row))
    if len(table.rows) > max_rows:
        out.caption = f"{max_rows} of {len(table.rows)} rows shown"
    return out


def run(
    settings: ReportSettings,
    *,
    view: str | None = None,
    sql: str | None = None,
    plot: str | Path | None = None,
    url: str | None = None,
    params: dict[str, Any] | None = None,
    console: Console | None = None,
) -> dict[str, Table]:
    """Show one view, one SQL result, or (neither given) every view; ``plot`` draws the view's
    chart to a file. ``params`` are the view's parameters (reports.VIEWS[view].params) or the
    SQL's ``{name:Type}`` parameters."""
    console = console or Console()
    params = dict(params or {})
    if view is not None and view not in reports.VIEWS:
        raise ReportError(f"no view {view!r}; views: {', '.join(reports.VIEWS)}")
    if plot is not None:
        if view is None:
            raise ReportError("--plot needs a view")
        if reports.VIEWS[view].chart is None:
            charted = [v.name for v in reports.VIEWS.values() if v.chart]
            raise ReportError(f"view {view} has no chart; views with one: {', '.join(charted)}")
    if sql is not None:
        check_read_only(sql)  # refuse before connecting anywhere
    source = _Source(settings, url or settings.analytics_url)
    shown: dict[str, Table] = {}
    try:
        if sql is not None:
            shown["sql"] = source.sql(sql, params)
            console.print(
                render(shown["sql"], sql.strip(), max_rows=settings.report_max_rows_shown)
            )
        names = [view] if view is not None else ([] if sql is not None else list(reports.VIEWS))
        for name in names:
            spec = reports.VIEWS[name]
            own = (
                params
                if view is not None
                else {k: v for k, v in params.items() if k in spec.params}
            )
            shown[name] = source.view(name, own)
            title = f"{spec.title}  ({name}, {source.database} at {source.where})"
            console.print(render(shown[name], title, max_rows=settings.report_max_rows_shown))
        if plot is not None and view is not None:
            path = reports.plot(view, shown[view], plot)
            console.print(f"plot written to {path}")
    finally:
        source.close()
    return shown
