"""The errors of rollstream.consumers.control: one root, ``ControlError``, a ``ConsumerError``.

    ConsumerError (rollstream.consumers.errors)
    └── ControlError (ValueError)   a bad value for the policy or the simulator: a Signals or
        │                           PolicyConfig field out of bounds, a Decision record that
        │                           does not validate; ``field`` names the field
        └── WorkloadError           a simulator workload that cannot be built (unknown name,
                                    unreadable JSON, a parameter out of bounds), an unknown
                                    simulated policy

Pure: no I/O.
"""

from __future__ import annotations

from rollstream.consumers.errors import ConsumerError

__all__ = ["ControlError", "WorkloadError"]


class ControlError(ConsumerError, ValueError):
    """A value the policy or the simulator refuses; ``field`` names it ("" when none does)."""

    def __init__(self, message: str, *, field: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class WorkloadError(ControlError):
    """A simulator workload or policy name that cannot be used."""
