"""The proxy over ASGI: the service (service.py) is framework-free; this module is the only one
of the proxy that knows Starlette and uvicorn. Every route of ``Proxy.endpoints()`` becomes a
Starlette route whose handler gets an ``HttpRequest`` and returns an ``Answer``.

Hot path: the model-call routes (POST to a chat/completions or completions URL) are served as
raw ASGI by ``ProxyApp``: no Starlette middleware, router, Request or Response per call (most of
what the framework costs per call), and the same answers and errors as through the routes
(tests/unit/test_proxy_fastpath.py compares both paths on every kind of bad input).

    rollstream proxy    ->  run(ProxySettings())     uvicorn, one worker
    tests, benchmarks   ->  create_app(settings, recorder=..., pool=..., chat=...)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rollstream.producers.errors import ApiError, ChatError
from rollstream.producers.proxy.chat import ChatTemplate
from rollstream.producers.proxy.openai_wire import (
    Answer,
    HttpRequest,
    as_api_error,
    bearer_token,
    error_answer,
    parse_json,
    too_large,
)
from rollstream.producers.proxy.pool import BackendPool
from rollstream.producers.proxy.service import Handler, Proxy, build_proxy
from rollstream.producers.proxy.settings import ProxySettings
from rollstream.producers.sdk.recorder import Recorder

__all__ = ["ProxyApp", "ProxySettings", "create_app", "run"]

log = logging.getLogger("rollstream.producers.proxy.service")

_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]


def _fast_route(path: str) -> tuple[bool, str | None] | None:
    """(chat?, rollout id from the URL) for the model-call routes, else None."""
    if path == "/v1/chat/completions":
        return True, None
    if path == "/v1/completions":
        return False, None
    if path.startswith("/rollouts/"):
        rid, slash, tail = path[10:].partition("/")
        if rid and slash:
            if tail == "v1/chat/completions":
                return True, rid
            if tail == "v1/completions":
                return False, rid
    return None


class ProxyApp(Starlette):
    """The proxy's Starlette app with the model-call routes served as raw ASGI: a POST to a
    chat/completions or completions URL skips Starlette's middleware, router, Request and
    Response and gets the same answers and errors as through the routes; every other request
    goes through Starlette. ``proxy`` (also ``state.proxy``) is the service."""

    proxy: Proxy

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            route = _fast_route(scope["path"])
            if route is not None:
                return await _serve_call(self.proxy, route[0], route[1], scope, receive, send)
        await super().__call__(scope, receive, send)


async def _serve_call(
    proxy: Proxy, chat: bool, rid: str | None, scope: Any, receive: Any, send: Any
) -> None:
    """One model call as raw ASGI; the same status codes and error objects as the routes."""
    token = declared = None
    for name, value in scope["headers"]:  # the first of each, as Starlette's Headers.get
        if name == b"authorization":
            if token is None:
                token = value.decode("latin-1")
        elif name == b"content-length" and declared is None:
            declared = value
    try:
        ro = proxy.open_rollout(bearer_token(token), rid)
        limit = proxy.settings.proxy_max_body_bytes
        too_large(declared, limit)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # http.disconnect: nobody to answer
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = parse_json(chunks[0] if len(chunks) == 1 else b"".join(chunks))
        answer = await (proxy.chat_call if chat else proxy.text_call)(ro, body)
    except Exception as exc:
        answer = _error(exc, scope["path"])
    headers = _SSE_HEADERS if answer.sse else _JSON_HEADERS
    if answer.headers:
        extra = [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers.items()
        ]
        headers = [*headers, *extra]
    start = [(b"content-length", b"%d" % len(answer.body)), *headers]
    await send({"type": "http.response.start", "status": answer.status, "headers": start})
    await send({"type": "http.response.body", "body": answer.body})


def _error(exc: Exception, path: str) -> Answer:
    if not isinstance(exc, ApiError | ChatError):  # a bug: answered 500 with the reason
        log.exception("unhandled error on %s", path)
    return error_answer(as_api_error(exc))


def _response(answer: Answer) -> Response:
    if answer.sse:
        headers = {"Cache-Control": "no-cache", **answer.headers}
        return Response(answer.body, answer.status, headers, media_type="text/event-stream")
    return Response(answer.body, answer.status, answer.headers, media_type="application/json")


async def read_body(request: Request, limit: int) -> bytes:
    """The body: 413 past ``limit`` bytes."""
    too_large(request.headers.get("content-length"), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object: 413 past ``limit`` bytes, 400 if not a JSON object."""
    return parse_json(await read_body(request, limit))


def _route(handler: Handler, limit: int) -> Callable[[Request], Any]:
    """A Starlette endpoint around a service handler: Request -> HttpRequest, Answer ->
    Response, every error an OpenAI error object (a 500 with the reason, never a dropped
    connection)."""

    async def endpoint(request: Request) -> Response:
        async def body() -> dict[str, Any]:
            return await read_json(request, limit)

        async def raw() -> bytes:
            return await read_body(request, limit)

        http = HttpRequest(
            token=bearer_token(request.headers.get("authorization"))
            or request.headers.get("x-api-key"),  # Anthropic's client sends its key there
            path=request.path_params,
            query=request.query_params,
            base_url=str(request.base_url),
            read_json=body,
            read_bytes=raw,
            headers=request.headers,
        )
        try:
            answer = await handler(http)
        except Exception as exc:
            answer = _error(exc, request.url.path)
        return _response(answer)

    return endpoint


def create_app(
    settings: ProxySettings,
    *,
    recorder: Recorder | None = None,
    pool: BackendPool | None = None,
    chat: ChatTemplate | None = None,
) -> ProxyApp:
    """The proxy app. A recorder or pool passed in is the caller's (not closed here); ones
    built from ``settings`` are closed at shutdown. ``app.state.proxy`` is the Proxy."""
    proxy = build_proxy(settings, recorder=recorder, pool=pool, chat=chat)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.stop()

    limit = settings.proxy_max_body_bytes
    routes = [
        Route(e.path, _route(e.handler, limit), methods=[e.method]) for e in proxy.endpoints()
    ]
    app = ProxyApp(routes=routes, lifespan=lifespan)
    app.proxy = app.state.proxy = proxy
    return app


def run(settings: ProxySettings) -> None:
    """Serve until interrupted (``rollstream proxy`` calls this)."""
    logging.basicConfig(level=settings.proxy_log_level.upper())
    uvicorn.run(
        create_app(settings),
        host=settings.proxy_host,
        port=settings.proxy_port,
        log_level=settings.proxy_log_level,
        access_log=False,
        timeout_keep_alive=30,
    )
