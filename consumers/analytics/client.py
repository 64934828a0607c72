"""The HTTP client of the analytics server (``rollstream report``, ``rollstream replay
--source clickhouse``, a notebook): the API is drawn in protocol.py.

    AnalyticsClient(url, *, timeout=120.0, api_key=None)    api_key: an analyst key, sent as
                                                           ``Authorization: Bearer KEY``

Errors: ``AnalyticsError`` when the server cannot be reached or is not ours, ``RefusedQuery``
for a refused statement (HTTP 403), ``AnalyticsHTTPError`` for any other error status (401: no
valid key; rollstream.consumers.errors).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import unquote

import httpx
from pydantic import SecretStr

from rollstream.consumers.analytics.protocol import LAST_HEADER, SERVICE, decode_frames
from rollstream.consumers.errors import AnalyticsError, AnalyticsHTTPError, RefusedQuery
from rollstream.consumers.store.chstore import Table

__all__ = ["AnalyticsClient"]


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

    def __init__(
        self, url: str, *, timeout: float = 120.0, api_key: SecretStr | str | None = None
    ) -> None:
        """``api_key``: an analyst key of the server (``analytics_api_keys``), sent as
        ``Authorization: Bearer KEY`` on every request; None for an open server."""
        self.url = url.rstrip("/")
        key = api_key.get_secret_value() if isinstance(api_key, SecretStr) else api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=headers)

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
        last = unquote(response.headers.get(LAST_HEADER, ""))
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
