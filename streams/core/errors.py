"""Errors of the pure stream core, and the codes of contract violations.

StreamsCoreError            root of rollstream.streams.core (a StreamsError: streams/errors.py)
├── ConfigError             a config that cannot work (unknown scorer name, bad numbers)
├── ContractViolation       an event or record that breaks the event contract; carries an
│   │                       InvalidCode. apply() never lets it out: it becomes an Invalid
│   │                       output value (bound for the DLQ)
│   └── InvalidTrajectory   a Trajectory record whose tree cannot be made into samples
├── ScoringError            a scoring function raised or returned the wrong number of scores
└── StateFormatError        bytes that are not a state written by state_to_bytes
"""

from __future__ import annotations

import enum

from rollstream.streams.errors import StreamsError

__all__ = [
    "ConfigError",
    "ContractViolation",
    "InvalidCode",
    "InvalidTrajectory",
    "ScoringError",
    "StateFormatError",
    "StreamsCoreError",
]


class InvalidCode(enum.StrEnum):
    """Why an event (or a trajectory) was refused. Short and stable: DLQ headers carry it."""

    WRONG_ROLLOUT = "wrong_rollout"  # applied to another rollout's state
    BAD_SEQ = "bad_seq"  # negative seq
    SEQ_CONFLICT = "seq_conflict"  # same seq as an earlier event, different event_id
    NOT_STARTED = "not_started"  # seq 0 is not RolloutStarted
    DUPLICATE_START = "duplicate_start"  # RolloutStarted after seq 0
    REJECTED = "rejected"  # the rollout was refused at seq 0; so is everything after
    AFTER_CLOSE = "after_close"  # an event past RolloutFinished or the inactivity timeout
    GAP_AT_TIMEOUT = "gap_at_timeout"  # buffered behind a gap that never filled
    REORDER_BUFFER_FULL = "reorder_buffer_full"  # too many out-of-order events buffered
    DUPLICATE_CALL_ID = "duplicate_call_id"
    UNKNOWN_PARENT = "unknown_parent"
    PREFIX_OUT_OF_RANGE = "prefix_out_of_range"
    LOGPROBS_LENGTH = "logprobs_length"
    UNKNOWN_CALL = "unknown_call"  # Reward / ToolCall / Branch naming a call never seen
    BAD_REWARD = "bad_reward"  # a reward value that is not a number in [-1e6, 1e6]
    LATE_TRAJECTORY = "late_trajectory"  # a new rollout for a group that already closed
    BAD_TRAJECTORY = "bad_trajectory"  # a Trajectory record whose tree is inconsistent


class StreamsCoreError(StreamsError):
    """Root of every error raised by rollstream.streams.core."""


class ConfigError(StreamsCoreError):
    """A configuration that cannot work."""


class ContractViolation(StreamsCoreError):
    """An input breaks the event contract. ``code`` classifies it, ``reason`` explains it."""

    def __init__(self, code: InvalidCode, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


class InvalidTrajectory(ContractViolation):
    """A Trajectory record whose nodes do not form a valid context tree."""

    def __init__(self, reason: str) -> None:
        super().__init__(InvalidCode.BAD_TRAJECTORY, reason)


class ScoringError(StreamsCoreError):
    """A scoring function failed: a bug in the function, not bad data."""


class StateFormatError(StreamsCoreError):
    """Bytes given to state_from_bytes that state_to_bytes did not write."""
