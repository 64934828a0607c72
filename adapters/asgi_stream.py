"""A streamed HTTP answer over raw ASGI that watches the client: shared by the recording proxy
and the reference model server.

    await send_stream(parts, status, headers, receive, send)

Sends ``parts`` (an async iterator of bytes) as a chunked body (no Content-Length) while
reading ``receive``: when the client hangs up, the sending stops and ``parts`` is closed at
once (its ``finally`` runs: a streamed call ends its backend request, a streamed completion
aborts its row). Starlette's StreamingResponse under ASGI spec 2.4 and uvicorn only notice a
hang-up when a write fails, and uvicorn drops writes to a closed connection silently, so the
hang-up is read from ``receive``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["send_stream"]

log = logging.getLogger("rollstream.adapters")


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
    await send({"type": "http.response.start", "status": status, "headers": headers})

    async def pump() -> None:
        async for part in parts:
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    tasks = [asyncio.ensure_future(pump()), asyncio.ensure_future(_hung_up(receive))]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        aclose = getattr(parts, "aclose", None)
        if aclose is not None:
            await aclose()
    if tasks[0].done() and not tasks[0].cancelled() and (exc := tasks[0].exception()):
        log.error("a streamed answer failed", exc_info=exc)
