"""The proxy's model-call routes as raw ASGI (see proxy.py): a POST to a chat/completions or
completions URL skips Starlette's middleware, router, Request and Response (most of what the
framework costs per call) and gets the same answers and errors as through the routes
(tests/unit/test_proxy_fastpath.py compares both paths on every kind of bad input)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette

from rollstream.producers.proxy.chat import ChatError
from rollstream.producers.proxy.openai_wire import (
    ApiError,
    bearer_token,
    error_body,
    parse_json,
    too_large,
)

if TYPE_CHECKING:
    from rollstream.producers.proxy.service import Proxy

__all__ = ["ProxyApp"]

log = logging.getLogger("rollstream.producers.proxy.service")

_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache")]  # fmt: skip


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
    Response (most of what the framework costs per call) and gets the same answers and
    errors as through the routes; every other request goes through Starlette."""

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
    """One model call as raw ASGI; the same status codes and error objects as ``_guard``."""
    token = declared = None
    for name, value in scope["headers"]:  # the first of each, as Starlette's Headers.get
        if name == b"authorization":
            if token is None:
                token = value.decode("latin-1")
        elif name == b"content-length" and declared is None:
            declared = value
    headers = _JSON_HEADERS
    try:
        ro = proxy.rollouts.get(proxy.auth.rollout_of(bearer_token(token), rid))
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
        payload, is_sse = await (proxy.chat_call if chat else proxy.text_call)(ro, body)
        status = 200
        if is_sse:
            headers = _SSE_HEADERS
    except Exception as exc:
        if isinstance(exc, ChatError) and not isinstance(exc, ApiError):
            exc = ApiError(400, str(exc))
        elif not isinstance(exc, ApiError):  # a 500 with the reason, never a dropped connection
            log.exception("unhandled error on %s", scope["path"])
            exc = ApiError(500, f"{type(exc).__name__}: {exc}", code="internal")
        status, payload = exc.status, error_body(exc)
        if exc.headers:
            extra = [(k.lower().encode("latin-1"), v.encode("latin-1"))
                     for k, v in exc.headers.items()]  # fmt: skip
            headers = [*headers, *extra]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-length", b"%d" % len(payload)), *headers]})  # fmt: skip
    await send({"type": "http.response.body", "body": payload})
