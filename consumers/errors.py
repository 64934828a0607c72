"""The errors of rollstream.consumers: one root, ``ConsumerError``, for the store, analytics and
training rooms. Each module re-exports the errors it raises, so ``from
rollstream.consumers.store.chstore import InsertError`` and ``from rollstream.consumers.errors
import InsertError`` name the same class.

    ConsumerError                   root of rollstream.consumers
    ├── StoreError                  the ClickHouse store (store/chstore.py, store/rows.py)
    │   ├── RowError                a record that cannot be mapped to rows (-> the DLQ)
    │   ├── ConnectError            bad URL, chDB path held by another process, no server
    │   ├── InsertError             an insert failed (``table``, ``token``, ``retryable``)
    │   ├── QueryError              a query or command failed (``sql``)
    │   └── MigrationError          a migration failed or an applied one was edited
    ├── SinkError                   the sink loop (store/sink.py)
    │   ├── DeadLetterError         a dead-letter record was not delivered (nothing committed)
    │   └── InsertRetryError        a retryable insert kept failing for sink_insert_retry_s
    ├── AnalyticsError              the analytics API, server and client (analytics/)
    │   ├── RefusedQuery            not a single read-only statement (HTTP 403)
    │   └── AnalyticsHTTPError      the server answered an error (``status``; client side)
    ├── ReportError                 a report that cannot be made (analytics/report_cli.py)
    ├── ReplayError                 bad replay settings, events not delivered (analytics/replay.py)
    ├── TrainerError                a PolicyVersion not published, a bad setting (training/)
    ├── CheckpointError             an inconsistent checkpoint root, a checkpoint that does not
    │                               fit the model (training/checkpoint.py)
    ├── SourceError                 the samples consumer failed: a fatal consumer error, a dead
    │                               letter not delivered, a failed commit (training/dataset.py)
    ├── TreeError (ValueError)      parent_indices that are not a DFS pre-order forest
    │                               (training/treepack.py)
    └── BatchingError (ValueError)  a sample that cannot be batched (training/batching.py)

The elastic controller's errors derive from ``ConsumerError`` too and live in its room
(control/errors.py): ``ControlError`` (ValueError; bad signals, settings or decisions, with
``.field``) and its ``WorkloadError`` (a simulator workload that cannot be used).

Errors from outside (the Kafka client, clickhouse-connect, the HTTP client) are wrapped into one
of these with ``raise ... from exc``. Records that cannot be stored or trained are not errors of
the process: they travel to the dead-letter topic as values (rollstream.schemas.dlq).
"""

from __future__ import annotations

__all__ = [
    "AnalyticsError",
    "AnalyticsHTTPError",
    "BatchingError",
    "CheckpointError",
    "ConnectError",
    "ConsumerError",
    "DeadLetterError",
    "InsertError",
    "InsertRetryError",
    "MigrationError",
    "QueryError",
    "RefusedQuery",
    "ReplayError",
    "ReportError",
    "RowError",
    "SinkError",
    "SourceError",
    "StoreError",
    "TrainerError",
    "TreeError",
]


class ConsumerError(Exception):
    """Root of every error of rollstream.consumers (the tree is in the module docstring)."""


# --- store ------------------------------------------------------------------------------------


class StoreError(ConsumerError):
    """Root of the ClickHouse store's errors."""


class RowError(StoreError):
    """A record that cannot be mapped to rows. ``reason`` says why; ``kind`` names the record."""

    def __init__(self, reason: str, kind: str = "") -> None:
        super().__init__(f"cannot map {kind or 'record'} to rows: {reason}")
        self.reason = reason
        self.kind = kind


class ConnectError(StoreError):
    """The store cannot be opened: bad URL, chDB path held by another process, no server."""


class InsertError(StoreError):
    """An insert failed. ``retryable`` is True for transport failures (the same batch with the
    same token can be sent again), False when the server rejected the data."""

    def __init__(self, message: str, *, table: str, token: str, retryable: bool) -> None:
        super().__init__(message)
        self.table = table
        self.token = token
        self.retryable = retryable


class QueryError(StoreError):
    """A query or command failed; ``sql`` is the statement."""

    def __init__(self, message: str, *, sql: str) -> None:
        super().__init__(message)
        self.sql = sql


class MigrationError(StoreError):
    """A schema migration failed, or a migration already applied was changed since."""


class SinkError(ConsumerError):
    """Root of the sink loop's errors."""


class DeadLetterError(SinkError):
    """A dead-letter record could not be delivered; the batch's offsets were not committed."""


class InsertRetryError(SinkError):
    """A retryable insert (transport failure) kept failing for ``sink_insert_retry_s``."""


# --- analytics --------------------------------------------------------------------------------


class AnalyticsError(ConsumerError):
    """Root of the analytics API's errors."""


class RefusedQuery(AnalyticsError):
    """The statement is not one read-only query."""


class AnalyticsHTTPError(AnalyticsError):
    """The analytics server answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"analytics server answered {status}: {message}")
        self.status = status


class ReportError(ConsumerError):
    """A report that cannot be made (unknown view, plot of a view without a chart, ...)."""


class ReplayError(ConsumerError):
    """A replay that cannot run (bad settings) or whose events were not delivered."""


# --- training ---------------------------------------------------------------------------------


class TrainerError(ConsumerError):
    """The trainer: a PolicyVersion that could not be published, a bad setting."""


class CheckpointError(ConsumerError):
    """A checkpoint root that is not a consistent store, a checkpoint that does not fit."""


class SourceError(ConsumerError):
    """The samples topic's consumer failed (fatal consumer error, undelivered dead letter,
    failed commit)."""


class TreeError(ConsumerError, ValueError):
    """parent_indices that do not describe a forest in DFS pre-order."""


class BatchingError(ConsumerError, ValueError):
    """A sample that cannot be batched; the message names the sample_id."""
