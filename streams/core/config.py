"""Configuration of the pure stream core: frozen dataclasses the faust shell builds from its
settings and passes down (nothing here reads the environment).

Time is in microseconds, in the clock of ``Event.ts``. The shell passes ``now_us`` to the
``expire`` functions: either wall-clock time or, for deterministic replays, an event-time
watermark (the largest ``ts`` seen on the partition).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rollstream.schemas.events import SampleMode

from .errors import ConfigError
from .scoring import SCORERS, ScoreFn

__all__ = ["AdvantageConfig", "BuilderConfig", "GroupConfig", "SampleConfig"]

_MINUTE_US = 60_000_000


@dataclass(frozen=True, slots=True)
class BuilderConfig:
    """Trajectory builder.

    inactivity_timeout_us: an open rollout with no new event for this long is closed by
        ``expire`` with status truncated.
    closed_retention_us: how long ``should_evict`` keeps a closed rollout's small tombstone (it
        makes late duplicates and events after close recognisable).
    max_pending: out-of-order events buffered per rollout; beyond it they go to the DLQ.
    dedup: merge calls with identical prompt and completion under the same tree parent.
    scorer: name of the scoring function in ``scorers``.
    """

    inactivity_timeout_us: int = 10 * _MINUTE_US
    closed_retention_us: int = 60 * _MINUTE_US
    max_pending: int = 10_000
    dedup: bool = True
    scorer: str = "default"
    scorers: Mapping[str, ScoreFn] = field(default_factory=lambda: SCORERS)

    def __post_init__(self) -> None:
        if self.scorer not in self.scorers:
            raise ConfigError(f"unknown scorer {self.scorer!r}; known: {sorted(self.scorers)}")
        if self.inactivity_timeout_us <= 0 or self.max_pending < 0:
            raise ConfigError("inactivity_timeout_us must be > 0 and max_pending >= 0")

    @property
    def score_fn(self) -> ScoreFn:
        return self.scorers[self.scorer]


@dataclass(frozen=True, slots=True)
class SampleConfig:
    """Sample builder. mode: path (one sample per leaf path) or tree (one packed sample per
    tree). share_prefixes: calls that start at the same point and begin with the same tokens
    (a retried prompt; root calls with the same system prompt) share those tokens in the token
    trie: stored once in tree mode. In path mode it only decides whether a call whose whole
    sequence is the start of another's still gets a sample of its own (off: it does)."""

    mode: SampleMode = SampleMode.PATH
    share_prefixes: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", SampleMode(self.mode))


@dataclass(frozen=True, slots=True)
class AdvantageConfig:
    """Rollout-level advantages: (r - baseline) / (std + eps).

    normalize_std: divide by the group's reward std (False: r - baseline only, Dr. GRPO).
    leave_one_out: baseline of rollout i is the mean of the others (RLOO) instead of the mean.
    std_ddof: 0 for the population std (default), 1 for the sample std.
    drop_zero_variance: groups whose rewards all agree (within zero_variance_tol) carry no
        signal and are dropped (DAPO dynamic sampling).
    """

    normalize_std: bool = True
    leave_one_out: bool = False
    eps: float = 1e-6
    std_ddof: int = 0
    drop_zero_variance: bool = True
    zero_variance_tol: float = 1e-12

    def __post_init__(self) -> None:
        if self.eps < 0 or self.std_ddof not in (0, 1) or self.zero_variance_tol < 0:
            raise ConfigError("eps and zero_variance_tol must be >= 0 and std_ddof 0 or 1")


@dataclass(frozen=True, slots=True)
class GroupConfig:
    """Group aggregator.

    group_size: rollouts per group when a trajectory does not say (Trajectory.group_size);
        None: such a group closes only on the timeout.
    timeout_us: a group closes with what arrived this long after its first trajectory
        finished (Trajectory.finished_ts).
    """

    group_size: int | None = None
    timeout_us: int = 15 * _MINUTE_US
    closed_retention_us: int = 60 * _MINUTE_US
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    samples: SampleConfig = field(default_factory=SampleConfig)

    def __post_init__(self) -> None:
        if self.group_size is not None and self.group_size < 1:
            raise ConfigError(f"group_size must be >= 1, got {self.group_size}")
        if self.timeout_us <= 0:
            raise ConfigError("timeout_us must be > 0")
