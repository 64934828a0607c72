"""The sink's counters (``Sink.stats``; the analytics server's ``GET /health`` shows them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["SinkStats"]


@dataclass
class SinkStats:
    messages: int = 0
    batches: int = 0
    rows: dict[str, int] = field(default_factory=dict)
    dead_letters: int = 0
    intents: int = 0
    commits: int = 0
    commit_failures: int = 0
    insert_retries: int = 0
    split_batches: int = 0
    verified_batches: int = 0  # re-read after an assignment, checked against the tables
    verified_rows_present: int = 0  # ... rows of them that were stored already (not re-sent)
    dropped_on_revoke: int = 0
    first_message_at: float = 0.0  # time.monotonic() of the first message (benchmarks)
    last_insert_at: float = 0.0  # ... and of the last insert

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "rows": dict(self.rows)}
