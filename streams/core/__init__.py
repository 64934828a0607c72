"""rollstream.streams.core: the pure logic of the stream processors (no faust, no Kafka).

    events --apply/expire--> Trajectory --add_to_group/expire_group--> Sample (with advantages)

- trajectory.py: per-rollout reducer ``apply(state, event, config) -> (state, outputs)``,
  ``expire`` on a timer; outputs are ``Trajectory`` (on close) and ``Invalid`` (for the DLQ).
- tree.py: the context tree from LlmCall parent_call_id / prefix_len, with deduplication.
- scoring.py: scoring functions (list in, list out) by name.
- trie.py, samples.py: the token trie of a trajectory; path-mode and tree-mode samples with
  deterministic ids.
- advantages.py, groups.py: rollout-level advantages and the group aggregator.
- snapshot.py: ``state_to_bytes`` / ``state_from_bytes`` for the shell's tables.
Errors: see errors.py (root ``StreamsCoreError``).
"""

from .advantages import advantages, is_zero_variance
from .config import AdvantageConfig, BuilderConfig, GroupConfig, SampleConfig
from .errors import (
    ConfigError,
    ContractViolation,
    InvalidCode,
    InvalidTrajectory,
    ScoringError,
    StateFormatError,
    StreamsCoreError,
)
from .groups import (
    GroupClosed,
    GroupOutput,
    GroupRejected,
    GroupState,
    GroupStats,
    add_to_group,
    expire_group,
    should_evict_group,
)
from .samples import build_samples, is_text_only, sample_id, text_only_calls
from .scoring import SCORERS, Score, ScoreFn, ScoreSource, default_score, final_only_score
from .snapshot import state_from_bytes, state_to_bytes
from .trajectory import (
    TRANSITIONS,
    Invalid,
    Phase,
    RolloutOutput,
    RolloutState,
    apply,
    expire,
    replay,
    should_evict,
)
from .tree import CallTree

__all__ = [
    "SCORERS",
    "TRANSITIONS",
    "AdvantageConfig",
    "BuilderConfig",
    "CallTree",
    "ConfigError",
    "ContractViolation",
    "GroupClosed",
    "GroupConfig",
    "GroupOutput",
    "GroupRejected",
    "GroupState",
    "GroupStats",
    "Invalid",
    "InvalidCode",
    "InvalidTrajectory",
    "Phase",
    "RolloutOutput",
    "RolloutState",
    "SampleConfig",
    "Score",
    "ScoreFn",
    "ScoreSource",
    "ScoringError",
    "StateFormatError",
    "StreamsCoreError",
    "add_to_group",
    "advantages",
    "apply",
    "build_samples",
    "default_score",
    "expire",
    "expire_group",
    "final_only_score",
    "is_text_only",
    "is_zero_variance",
    "replay",
    "sample_id",
    "should_evict",
    "should_evict_group",
    "state_from_bytes",
    "state_to_bytes",
    "text_only_calls",
]
