"""A streamed HTTP answer over raw ASGI that watches the client: shared by the recording proxy
and the reference model server.

    await send_stream(parts, status, headers, receive, send)

Sends ``parts`` (an async iterator of bytes) as a chunked body (no Content-Length) while
reading ``receive``: when the client hangs up, the sending stops and ``parts`` is closed at
once (its ``finally`` runs: a streamed call ends its backend request, a streamed completion
aborts its row). Starlette's StreamingResponse under ASGI spec 2.4 and uvicorn only notice a
hang-up when a write fails, and uvicorn drops writes to a closed connection silently, so the
hang-up is read from ``receive``.

Writes: the head (``http.response.start``) waits for the first part and goes out right before
it, in the same turn of the event loop; a part marked ``LastPart`` ends the body in the same
write (``more_body`` False) and ``parts`` is closed after it, so whatever its ``finally`` still
does (the proxy reads its backend's stream to the end) happens after the client has the whole
answer. The parts are sent from the caller's task; a second task reads ``receive`` and cancels
the caller's on a hang-up (that cancellation is absorbed here).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["LastPart", "send_stream"]

log = logging.getLogger("rollstream.adapters")

_END = {"type": "http.response.body", "body": b"", "more_body": False}


class LastPart(bytes):
    """The last part of a streamed body: sent with the end of the body in one write."""

    __slots__ = ()


async def _hung_up(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def send_stream(
    parts: AsyncIterator[bytes],
    status: int,
    headers: list[tuple[bytes, bytes]],
    receive: Any,
    send: Any,
) -> None:
    """Send ``parts`` until they end or the client hangs up (module docstring)."""
    task = asyncio.current_task()
    assert task is not None
    hung_up = False

    def on_hang_up(watcher: asyncio.Future[None]) -> None:
        nonlocal hung_up
        if not watcher.cancelled() and watcher.exception() is None:
            hung_up = True
            task.cancel()

    watcher = asyncio.ensure_future(_hung_up(receive))
    watcher.add_done_callback(on_hang_up)
    head: dict[str, Any] | None = {
        "type": "http.response.start",
        "status": status,
        "headers": headers,
    }
    try:
        try:
            async for part in parts:
                last = type(part) is LastPart
                if head is not None:
                    await send(head)
                    head = None
                await send({"type": "http.response.body", "body": part, "more_body": not last})
                if last:
                    break
            else:
                if head is not None:
                    await send(head)
                await send(_END)
        finally:  # no await between the last write and this: a hang-up now changes nothing
            watcher.remove_done_callback(on_hang_up)
            watcher.add_done_callback(_retrieve)
            watcher.cancel()
    except asyncio.CancelledError:
        if not hung_up or task.uncancel() > 0:  # not (only) ours: the server's, pass it on
            raise
    except Exception as exc:
        log.error("a streamed answer failed", exc_info=exc)
    finally:
        aclose = getattr(parts, "aclose", None)
        if aclose is not None:
            await aclose()


def _retrieve(watcher: asyncio.Future[None]) -> None:
    if not watcher.cancelled():
        watcher.exception()  # a receive that failed: nothing to report once the answer is out
