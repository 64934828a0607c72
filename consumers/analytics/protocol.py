"""The analytics HTTP API as both ends see it (pure): the service name ``/health`` answers
with, and the frames of ``POST /events``.

    GET  /health                      {"service": SERVICE, database, namespace, sink}
    POST /query   {sql, params?}      {"columns": [...], "rows": [[...], ...]}   read-only
    GET  /reports                     the canned views (reports.VIEWS) and their parameters
    GET  /reports/{view}?namespace=&k=v   {"view", "title", "columns", "rows"}
    POST /events  {namespace, filter, after, limit}   a page of whole rollouts
                                       (store.queries.RolloutFilter as JSON), framed: key, then
                                       Codec value, per event, in (rollout_id, seq) order;
                                       header LAST_HEADER = the page's last rollout_id,
                                       percent-encoded ("" when the page is the last)
    POST /events/count {namespace, filter}            {"rollouts": n, "events": m}

A frame is a 4-byte big-endian length, then that many bytes.
"""

from __future__ import annotations

import struct

from rollstream.consumers.errors import AnalyticsError

__all__ = [
    "LAST_HEADER",
    "RECORDS_HEADER",
    "SERVICE",
    "decode_frames",
    "encode_frames",
]

SERVICE = "rollstream-analytics"
LAST_HEADER = "X-Rollstream-Last"
RECORDS_HEADER = "X-Rollstream-Records"
_FRAME = struct.Struct(">I")


def encode_frames(records: list[bytes]) -> bytes:
    return b"".join(_FRAME.pack(len(r)) + r for r in records)


def decode_frames(data: bytes) -> list[bytes]:
    out: list[bytes] = []
    view = memoryview(data)
    i = 0
    while i < len(view):
        if i + 4 > len(view):
            raise AnalyticsError("truncated frame header")
        (size,) = _FRAME.unpack_from(view, i)
        i += 4
        if i + size > len(view):
            raise AnalyticsError("truncated frame")
        out.append(bytes(view[i : i + size]))
        i += size
    return out
