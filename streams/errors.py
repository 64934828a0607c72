"""Every error rollstream.streams raises, under one root (standard library only: the pure core
imports its root from here).

    StreamsError                root of rollstream.streams
    ├── StreamsCoreError        (core/errors.py) root of the pure core's errors: ConfigError,
    │                           ContractViolation (-> InvalidTrajectory), ScoringError,
    │                           StateFormatError; drawn there
    └── ProcessorError          the faust shell's errors (raised in app.py)
        └── TopicMissingError   a topic the processor reads does not exist (run
                                ``rollstream topics`` / ``up``)

A record that breaks the contract is not an exception that escapes: it becomes a dead letter
(schemas/dlq.py) with its reason.
"""

from __future__ import annotations

__all__ = ["ProcessorError", "StreamsError", "TopicMissingError"]


class StreamsError(Exception):
    """Root of every error raised by rollstream.streams."""


class ProcessorError(StreamsError):
    """Root of the processor shell's errors."""


class TopicMissingError(ProcessorError):
    """A topic the processor reads does not exist (run ``rollstream topics`` / ``up``)."""
