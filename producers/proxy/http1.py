"""A lean HTTP/1.1 keep-alive client: the proxy's hop to its backends.

httpx's default transport (httpcore) costs about a millisecond of CPU per request, which is most
of what the proxy adds to a call. ``Http1Transport`` does the same job for plain-HTTP backends
in a fraction of that. It is used two ways:

- ``Http1Transport.exchange(...)``: raw bytes in, ``(status, headers, body)`` out, no httpx
  objects built at all. ``CompletionBackend.complete`` (the per-call hot path) uses this.
- ``httpx.AsyncClient(transport=Http1Transport())``: the same connections behind httpx's API,
  for everything that is not per call (health, weight updates, pause/resume).

Scope, on purpose: ``http://`` only (backends sit next to the proxy; anything else goes through
httpcore), HTTP/1.1 with keep-alive, one request per connection at a time, ``Content-Length`` or
chunked responses, no proxies, no HTTP/2.

Connections: an idle pool per (host, port), reused last-in first-out, at most
``max_connections`` open. A request sent on a reused connection that the server had already
closed (EOF before any response byte) is retried once on a fresh connection: the server never
read it. Errors are httpx's (ConnectError, ConnectTimeout, ReadError, ReadTimeout, WriteError,
WriteTimeout, RemoteProtocolError, PoolTimeout) so callers handle both paths alike. Timeouts are
a dict with the keys connect/read/write/pool (seconds or None), as httpx passes them in
``request.extensions["timeout"]``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx

__all__ = ["Http1Transport", "RawResponse"]

_MAX_HEADER = 64 * 1024
_NO_TIMEOUTS: dict[str, Any] = {}

RawResponse = tuple[int, list[tuple[bytes, bytes]], bytes]  # status, headers, body


class _Conn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class Http1Transport(httpx.AsyncBaseTransport):
    """``httpx.AsyncClient(transport=Http1Transport())`` (https URLs fall back to httpcore), or
    ``await transport.exchange(...)`` without httpx on the way."""

    def __init__(self, *, max_connections: int = 512) -> None:
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._slots = asyncio.Semaphore(max_connections)
        self._fallback: httpx.AsyncHTTPTransport | None = None

    async def exchange(
        self, host: str, port: int, head: bytes, body: bytes = b"",
        timeouts: dict[str, Any] = _NO_TIMEOUTS, *, method: str = "POST",
        request: httpx.Request | None = None,
    ) -> RawResponse:  # fmt: skip
        """Send ``head`` (a complete request head, Content-Length included when there is a
        body) and ``body`` to host:port over a pooled keep-alive connection; return the status,
        the response headers (raw; Transfer-Encoding removed) and the whole body."""
        key = (host, port)
        slots = self._slots
        try:
            if slots.locked():
                async with asyncio.timeout(timeouts.get("pool")):
                    await slots.acquire()
            else:
                await slots.acquire()
        except TimeoutError:
            raise httpx.PoolTimeout("no free connection", request=request) from None
        try:
            idle = self._idle.get(key)
            reused = bool(idle)
            conn = idle.pop() if idle else await self._connect(key, timeouts, request)
            try:
                status, headers, content, keep = await self._exchange(
                    conn, head, body, timeouts, request, reused, method
                )
            except _Stale:
                conn.close()
                conn = await self._connect(key, timeouts, request)
                status, headers, content, keep = await self._exchange(
                    conn, head, body, timeouts, request, False, method
                )
            except BaseException:
                conn.close()
                raise
            if keep:
                if idle is None:
                    self._idle[key] = idle = []
                idle.append(conn)
            else:
                conn.close()
        finally:
            slots.release()
        return status, headers, content

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            if self._fallback is None:
                self._fallback = httpx.AsyncHTTPTransport()
            return await self._fallback.handle_async_request(request)
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        head, body = self._serialize(request, await request.aread())
        status, headers, content = await self.exchange(
            url.host, url.port or 80, head, body, timeouts, method=request.method, request=request
        )
        return httpx.Response(status, headers=headers, content=content, request=request)

    @staticmethod
    def _serialize(request: httpx.Request, body: bytes) -> tuple[bytes, bytes]:
        url = request.url
        target = url.raw_path.decode("ascii")
        lines = [f"{request.method} {target} HTTP/1.1"]
        has_host = has_length = False
        for name, value in request.headers.raw:
            low = name.lower()
            if low == b"host":
                has_host = True
            elif low == b"content-length":
                has_length = True
            elif low == b"transfer-encoding":
                continue  # the body is sent whole, with a Content-Length
            lines.append(f"{name.decode('latin-1')}: {value.decode('latin-1')}")
        if not has_host:
            lines.append(f"Host: {url.netloc.decode('ascii')}")
        if not has_length and (body or request.method in ("POST", "PUT", "PATCH")):
            lines.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"), body

    @staticmethod
    async def _connect(
        key: tuple[str, int], timeouts: dict[str, Any], request: httpx.Request | None
    ) -> _Conn:
        try:
            async with asyncio.timeout(timeouts.get("connect")):
                reader, writer = await asyncio.open_connection(key[0], key[1], limit=_MAX_HEADER)
        except TimeoutError:
            raise httpx.ConnectTimeout(
                f"connect to {key[0]}:{key[1]} timed out", request=request
            ) from None
        except OSError as exc:
            raise httpx.ConnectError(
                f"connect to {key[0]}:{key[1]}: {exc}", request=request
            ) from exc
        return _Conn(reader, writer)

    async def _exchange(
        self, conn: _Conn, head: bytes, body: bytes, timeouts: dict[str, Any],
        request: httpx.Request | None, reused: bool, method: str,
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes, bool]:  # fmt: skip
        writer = conn.writer
        try:
            if len(body) < 65536:
                writer.write(head + body)
            else:
                writer.write(head)
                writer.write(body)
            if writer.transport.get_write_buffer_size():
                async with asyncio.timeout(timeouts.get("write")):
                    await writer.drain()
        except TimeoutError:
            raise httpx.WriteTimeout("write timed out", request=request) from None
        except OSError as exc:
            if reused:
                raise _Stale from exc
            raise httpx.WriteError(str(exc), request=request) from exc
        try:
            read = timeouts.get("read")
            if read is None:
                return await self._read(conn.reader, request, method)
            async with asyncio.timeout(read):  # no extra task, unlike wait_for
                return await self._read(conn.reader, request, method)
        except TimeoutError:
            raise httpx.ReadTimeout("read timed out", request=request) from None
        except asyncio.IncompleteReadError as exc:
            if reused and not exc.partial and not getattr(exc, "started", False):
                raise _Stale from exc
            raise httpx.ReadError("connection closed by the server", request=request) from exc
        except asyncio.LimitOverrunError as exc:
            raise httpx.RemoteProtocolError("response head too large", request=request) from exc
        except (ConnectionError, OSError) as exc:
            if reused:
                raise _Stale from exc
            raise httpx.ReadError(str(exc), request=request) from exc

    @staticmethod
    async def _read(
        reader: asyncio.StreamReader, request: httpx.Request | None, method: str
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes, bool]:
        raw = await reader.readuntil(b"\r\n\r\n")
        try:
            status_line, *header_lines = raw[:-4].split(b"\r\n")
            version, code, *_ = status_line.split(b" ", 2)
            status = int(code)
            headers = [
                (name.strip(), value.strip())
                for name, _, value in (line.partition(b":") for line in header_lines)
            ]
        except ValueError as exc:
            raise httpx.RemoteProtocolError(
                f"bad response head {raw[:80]!r}", request=request
            ) from exc
        keep = version == b"HTTP/1.1"
        length: int | None = None
        chunked = False
        for name, value in headers:
            low = name.lower()
            if low == b"content-length":
                length = int(value)
            elif low == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif low == b"connection":
                keep = value.lower() != b"close"
        try:
            if chunked:
                parts = []
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
                    data = await reader.readexactly(size + 2)
                    if size == 0:
                        break
                    parts.append(data[:-2])
                content = b"".join(parts)
                headers = [(n, v) for n, v in headers if n.lower() != b"transfer-encoding"]
            elif length is not None:
                content = await reader.readexactly(length)
            elif status in (204, 304) or 100 <= status < 200 or method == "HEAD":
                content = b""
            else:  # delimited by the end of the connection
                content, keep = await reader.read(), False
        except asyncio.IncompleteReadError as exc:
            exc.started = True  # type: ignore[attr-defined]  # the server did answer: not stale
            raise
        return status, headers, content, keep

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        if self._fallback is not None:
            await self._fallback.aclose()


class _Stale(Exception):
    """A reused connection the server had closed: resend on a fresh one."""
