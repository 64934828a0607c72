"""A lean HTTP/1.1 keep-alive client: the proxy's hop to its backends.

httpx's default transport (httpcore) costs about a millisecond of CPU per request, which is most
of what the proxy adds to a call. ``Http1Transport`` does the same job for plain-HTTP backends
in a fraction of that, and in about half the CPU per call of aiohttp's client
(bench/bench_proxy.py --http-client http1,aiohttp,httpx; ``proxy_http_client`` picks the
client). It is used two ways:

- ``Http1Transport.exchange(...)``: raw bytes in, ``(status, headers, body)`` out, no httpx
  objects built at all. ``CompletionBackend.complete`` (the per-call hot path) uses this.
- ``httpx.AsyncClient(transport=Http1Transport())``: the same connections behind httpx's API,
  for everything that is not per call (health, weight updates, pause/resume).
- ``async with Http1Transport.stream(...) as (status, headers, parts)``: the body handed out
  piece by piece as it arrives (a streamed completion). A stream read to its end returns its
  connection to the pool; one left early closes it, so the server sees the client go.

Scope, on purpose: ``http://`` only (backends sit next to the proxy; anything else goes through
httpcore), HTTP/1.1 with keep-alive, one request per connection at a time, ``Content-Length``,
chunked or connection-delimited responses, no proxies, no HTTP/2.

Connections: an idle pool per (host, port), reused last-in first-out, at most
``max_connections`` open. A request sent on a reused connection that the server had already
closed (EOF before any response byte) is retried once on a fresh connection: the server never
read it. Timeouts are a dict with the keys connect/read/write/pool (seconds or None), as httpx
passes them in ``request.extensions["timeout"]``.

Errors: ``exchange`` raises only ``Http1Error`` (producers/errors.py; a BackendUnavailable, so
the pool fails over), whose ``kind`` is the httpx error it stands for: ConnectError,
ConnectTimeout, ReadError, ReadTimeout, WriteError, WriteTimeout, PoolTimeout, and
RemoteProtocolError for an answer that is not valid HTTP/1.1 (a bad status line, header line,
Content-Length or chunk size, a body cut short). Under httpx the transport raises that httpx
error instead, as httpcore would. tests/unit/test_http1.py checks both against httpx's own
transport on the same well-formed and malformed answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx

from rollstream.producers.errors import Http1Error

__all__ = ["Http1Error", "Http1Transport", "RawResponse"]

_MAX_HEADER = 64 * 1024
_NO_TIMEOUTS: dict[str, Any] = {}
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] (\d{3})(?: [^\r\n]*)?")
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # a header name (RFC 9110 token)
_DIGITS = re.compile(rb"[0-9]+")
_HEX = re.compile(rb"[0-9A-Fa-f]+")

RawResponse = tuple[int, list[tuple[bytes, bytes]], bytes]  # status, headers, body


class _Conn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class _Stale(Exception):  # control flow inside exchange only: never raised out of it
    """A reused connection the server had closed: resend on a fresh one."""


def _bad(message: str) -> Http1Error:
    return Http1Error("RemoteProtocolError", message)


class Http1Transport(httpx.AsyncBaseTransport):
    """``httpx.AsyncClient(transport=Http1Transport())`` (https URLs fall back to httpcore), or
    ``await transport.exchange(...)`` without httpx on the way."""

    def __init__(self, *, max_connections: int = 512) -> None:
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._slots = asyncio.Semaphore(max_connections)
        self._fallback: httpx.AsyncHTTPTransport | None = None

    async def exchange(
        self,
        host: str,
        port: int,
        head: bytes,
        body: bytes = b"",
        timeouts: dict[str, Any] = _NO_TIMEOUTS,
        *,
        method: str = "POST",
    ) -> RawResponse:
        """Send ``head`` (a complete request head, Content-Length included when there is a
        body) and ``body`` to host:port over a pooled keep-alive connection; return the status,
        the response headers (raw; Transfer-Encoding removed) and the whole body. Raises
        Http1Error."""
        key = (host, port)
        slots = self._slots
        try:
            if slots.locked():
                async with asyncio.timeout(timeouts.get("pool")):
                    await slots.acquire()
            else:
                await slots.acquire()
        except TimeoutError:
            raise Http1Error("PoolTimeout", "no free connection") from None
        try:
            idle = self._idle.get(key)
            reused = bool(idle)
            conn = idle.pop() if idle else await self._connect(key, timeouts)
            try:
                status, headers, content, keep = await self._exchange(
                    conn, head, body, timeouts, reused, method
                )
            except _Stale:
                conn.close()
                conn = await self._connect(key, timeouts)
                try:
                    status, headers, content, keep = await self._exchange(
                        conn, head, body, timeouts, False, method
                    )
                except BaseException:
                    conn.close()
                    raise
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

    @contextlib.asynccontextmanager
    async def stream(
        self,
        host: str,
        port: int,
        head: bytes,
        body: bytes = b"",
        timeouts: dict[str, Any] = _NO_TIMEOUTS,
    ) -> AsyncIterator[tuple[int, list[tuple[bytes, bytes]], AsyncIterator[bytes]]]:
        """POST ``head`` + ``body`` like ``exchange``, but yield ``(status, headers, parts)``
        once the response head is in: ``parts`` gives the body as it arrives (chunked,
        Content-Length or connection-delimited; each read within the read timeout). The
        connection goes back to the pool only when the body was read to its end; leaving the
        block earlier closes it. Raises Http1Error, also while ``parts`` is read."""
        key = (host, port)
        slots = self._slots
        try:
            if slots.locked():
                async with asyncio.timeout(timeouts.get("pool")):
                    await slots.acquire()
            else:
                await slots.acquire()
        except TimeoutError:
            raise Http1Error("PoolTimeout", "no free connection") from None
        conn: _Conn | None = None
        try:
            idle = self._idle.get(key)
            reused = bool(idle)
            conn = idle.pop() if idle else await self._connect(key, timeouts)
            try:
                got = await self._stream_head(conn, head, body, timeouts, reused)
            except _Stale:
                conn.close()
                conn = await self._connect(key, timeouts)
                got = await self._stream_head(conn, head, body, timeouts, False)
            status, headers, length, chunked, keep = got
            body_reader = _BodyReader(conn.reader, length, chunked, timeouts.get("read"))
            yield status, headers, body_reader.parts()
            if keep and body_reader.done:
                self._idle.setdefault(key, []).append(conn)
                conn = None
        finally:
            if conn is not None:
                conn.close()
            self._slots.release()

    async def _stream_head(
        self, conn: _Conn, head: bytes, body: bytes, timeouts: dict[str, Any], reused: bool
    ) -> tuple[int, list[tuple[bytes, bytes]], int | None, bool, bool]:
        await _send(conn, head, body, timeouts, reused)
        try:
            async with asyncio.timeout(timeouts.get("read")):
                return await _read_head(conn.reader, reused)
        except TimeoutError:
            raise Http1Error("ReadTimeout", "read timed out") from None
        except asyncio.LimitOverrunError as exc:
            raise _bad("response head too long") from exc
        except (ConnectionError, OSError) as exc:
            if reused:
                raise _Stale from exc
            raise Http1Error("ReadError", str(exc) or type(exc).__name__) from exc

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            if self._fallback is None:
                self._fallback = httpx.AsyncHTTPTransport()
            return await self._fallback.handle_async_request(request)
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        head, body = self._serialize(request, await request.aread())
        try:
            status, headers, content = await self.exchange(
                url.host, url.port or 80, head, body, timeouts, method=request.method
            )
        except Http1Error as exc:  # as httpcore would raise it
            raise getattr(httpx, exc.kind)(str(exc), request=request) from exc
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
    async def _connect(key: tuple[str, int], timeouts: dict[str, Any]) -> _Conn:
        try:
            async with asyncio.timeout(timeouts.get("connect")):
                reader, writer = await asyncio.open_connection(key[0], key[1], limit=_MAX_HEADER)
        except TimeoutError:
            raise Http1Error("ConnectTimeout", f"connect to {key[0]}:{key[1]} timed out") from None
        except OSError as exc:
            raise Http1Error("ConnectError", f"connect to {key[0]}:{key[1]}: {exc}") from exc
        return _Conn(reader, writer)

    async def _exchange(
        self,
        conn: _Conn,
        head: bytes,
        body: bytes,
        timeouts: dict[str, Any],
        reused: bool,
        method: str,
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes, bool]:
        await _send(conn, head, body, timeouts, reused)
        try:
            read = timeouts.get("read")
            if read is None:
                return await self._read(conn.reader, method, reused)
            async with asyncio.timeout(read):  # no extra task, unlike wait_for
                return await self._read(conn.reader, method, reused)
        except TimeoutError:
            raise Http1Error("ReadTimeout", "read timed out") from None
        except asyncio.LimitOverrunError as exc:
            raise _bad("response head or chunk line too long") from exc
        except (ConnectionError, OSError) as exc:
            if reused:
                raise _Stale from exc
            raise Http1Error("ReadError", str(exc) or type(exc).__name__) from exc

    @staticmethod
    async def _read(
        reader: asyncio.StreamReader, method: str, reused: bool
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes, bool]:
        """One response: its head (informational 1xx answers skipped), then its body framed by
        Content-Length, chunked encoding or the end of the connection."""
        status, headers, length, chunked, keep = await _read_head(reader, reused)
        try:
            if status in (204, 304) or 100 <= status < 200 or method == "HEAD":
                content = b""
            elif chunked:
                content = await _read_chunked(reader)
                headers = [(n, v) for n, v in headers if n.lower() != b"transfer-encoding"]
            elif length is not None:
                content = await reader.readexactly(length)
            else:  # delimited by the end of the connection
                content, keep = await reader.read(), False
        except asyncio.IncompleteReadError as exc:  # the server did answer: not stale
            raise _bad("server closed the connection before the end of the body") from exc
        return status, headers, content, keep

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        if self._fallback is not None:
            await self._fallback.aclose()


async def _send(
    conn: _Conn, head: bytes, body: bytes, timeouts: dict[str, Any], reused: bool
) -> None:
    """Write a request (head and body; a large body as a second write, not copied), waiting
    for the socket only when it pushes back. A reused connection that fails to take it is
    ``_Stale`` (the caller retries on a fresh one)."""
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
        raise Http1Error("WriteTimeout", "write timed out") from None
    except OSError as exc:
        if reused:
            raise _Stale from exc
        raise Http1Error("WriteError", str(exc) or type(exc).__name__) from exc


async def _read_head(
    reader: asyncio.StreamReader, reused: bool
) -> tuple[int, list[tuple[bytes, bytes]], int | None, bool, bool]:
    """A response head, informational 1xx answers skipped: (status, headers, Content-Length,
    chunked?, keep-alive?)."""
    first = True
    while True:
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if first and reused and not exc.partial:
                raise _Stale from exc  # closed while idle: the server never read it
            raise _bad("server disconnected without sending a complete response") from exc
        first = False
        status, headers = _parse_head(raw)
        if not 100 <= status < 200 or status == 101:
            break
    version_11 = raw.startswith(b"HTTP/1.1")
    keep = version_11
    length: int | None = None
    chunked = False
    for name, value in headers:
        low = name.lower()
        if low == b"content-length":
            length = _content_length(value, length)
        elif low == b"transfer-encoding":
            codings = [c.strip() for c in value.lower().split(b",")]
            if codings[-1] != b"chunked":
                raise _bad(f"unsupported Transfer-Encoding {value[:40]!r}")
            chunked = True
        elif low == b"connection":
            tokens = {t.strip() for t in value.lower().split(b",")}
            keep = b"keep-alive" in tokens if not version_11 else b"close" not in tokens
    return status, headers, length, chunked, keep


def _parse_head(raw: bytes) -> tuple[int, list[tuple[bytes, bytes]]]:
    """(status, headers) of a response head (``raw`` ends with the blank line)."""
    status_line, *lines = raw[:-4].split(b"\r\n")
    m = _STATUS_LINE.fullmatch(status_line)
    if m is None:
        raise _bad(f"bad status line {status_line[:80]!r}")
    headers = []
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or _TOKEN.fullmatch(name) is None:
            raise _bad(f"bad header line {line[:80]!r}")
        headers.append((name, value.strip()))
    return int(m.group(1)), headers


def _content_length(value: bytes, seen: int | None) -> int:
    """A Content-Length value (``5`` or ``5, 5``), equal to any seen before."""
    values = {v.strip() for v in value.split(b",")}
    if len(values) != 1 or _DIGITS.fullmatch(next(iter(values))) is None:
        raise _bad(f"bad Content-Length {value[:40]!r}")
    length = int(values.pop())
    if seen is not None and seen != length:
        raise _bad("conflicting Content-Length headers")
    return length


def _chunk_size(line: bytes) -> int:
    """The size of a chunk from its size line (extensions ignored); ``_bad`` if none."""
    size_text = line[:-2].split(b";", 1)[0].strip()
    if _HEX.fullmatch(size_text) is None:
        raise _bad(f"bad chunk size {line[:40]!r}")
    return int(size_text, 16)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while True:
        size = _chunk_size(await reader.readuntil(b"\r\n"))
        if size == 0:
            break
        data = await reader.readexactly(size + 2)
        if data[-2:] != b"\r\n":
            raise _bad("chunk data longer than its size")
        parts.append(data[:-2])
    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailer fields, up to the blank line
        pass
    return b"".join(parts)


class _ReadDeadline:
    """The read timeout of a streamed body: each ``with deadline:`` block (one read) must end
    within ``seconds``, else the read fails with TimeoutError, as under ``asyncio.timeout``,
    but with one timer for the whole body, moved on only when it fires before the read in
    progress is due (an ``asyncio.timeout`` per read costs a timer, a Timeout object and a
    look-up of the current task per streamed token). The timeout is set on the reader (its
    pending and later reads raise it): the connection is not reused after it. ``close()`` at
    the end."""

    __slots__ = ("_due", "_handle", "_loop", "_reader", "_reading", "seconds")

    def __init__(self, reader: asyncio.StreamReader, seconds: float) -> None:
        self.seconds = seconds
        self._reader = reader
        self._loop = asyncio.get_running_loop()
        self._handle: asyncio.TimerHandle | None = None
        self._reading = False
        self._due = 0.0

    def __enter__(self) -> None:
        self._reading = True
        self._due = self._loop.time() + self.seconds
        if self._handle is None:
            self._handle = self._loop.call_at(self._due, self._expire)

    def __exit__(self, *exc: object) -> None:
        self._reading = False

    def _expire(self) -> None:
        self._handle = None
        if not self._reading:  # between reads: the next read sets a timer again
            return
        if self._loop.time() < self._due:  # a later read: its own due time
            self._handle = self._loop.call_at(self._due, self._expire)
            return
        self._reader.set_exception(TimeoutError("read timed out"))

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class _NoDeadline:
    """``with`` blocks without a timeout (a read timeout of None)."""

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        pass

    def close(self) -> None:
        pass


class _BodyReader:
    """A response body read piece by piece: chunked, ``length`` bytes, or up to the end of the
    connection. ``done`` once the whole body was read."""

    def __init__(
        self, reader: asyncio.StreamReader, length: int | None, chunked: bool, read: Any
    ) -> None:
        self.reader, self.length, self.chunked, self.read_s = reader, length, chunked, read
        self.done = False

    async def parts(self) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive (one generator, no layer per piece: each piece of
        a streamed completion is a token); read failures as Http1Error."""
        reader, read_s = self.reader, self.read_s
        deadline = _NoDeadline() if read_s is None else _ReadDeadline(reader, read_s)
        try:
            if self.chunked:
                while True:
                    try:
                        with deadline:  # one deadline per chunk: its line and data
                            size = _chunk_size(await reader.readuntil(b"\r\n"))
                            if size == 0:
                                break
                            data = await reader.readexactly(size + 2)
                    except _READ_ERRORS as exc:
                        raise _read_error(exc) from exc
                    if data[-2:] != b"\r\n":
                        raise _bad("chunk data longer than its size")
                    yield data[:-2]
                try:
                    with deadline:
                        while await reader.readuntil(b"\r\n") != b"\r\n":  # trailer fields
                            pass
                except _READ_ERRORS as exc:
                    raise _read_error(exc) from exc
            else:
                left = self.length
                while left is None or left:
                    try:
                        with deadline:
                            data = await reader.read(65536 if left is None else min(left, 65536))
                    except _READ_ERRORS as exc:
                        raise _read_error(exc) from exc
                    if not data:
                        if left is None:  # delimited by the end of the connection
                            break
                        raise _bad("server closed the connection before the end of the body")
                    if left is not None:
                        left -= len(data)
                    yield data
        finally:
            deadline.close()
        self.done = True


_READ_ERRORS = (
    TimeoutError,
    asyncio.LimitOverrunError,
    asyncio.IncompleteReadError,
    ConnectionError,
    OSError,
)


def _read_error(exc: BaseException) -> Http1Error:
    """The Http1Error of a failed read of a body."""
    if isinstance(exc, TimeoutError):
        return Http1Error("ReadTimeout", "read timed out")
    if isinstance(exc, asyncio.LimitOverrunError):
        return _bad("chunk line too long")
    if isinstance(exc, asyncio.IncompleteReadError):
        return _bad("server closed the connection before the end of the body")
    return Http1Error("ReadError", str(exc) or type(exc).__name__)
