"""Settings of the stream processor deployable (``rollstream process``).

``ProcessorSettings`` extends ``CommonSettings`` (Kafka, namespace, home); processor-only
variables are ``ROLLSTREAM_PROC_*``. Built in ``main()`` and passed down: the app factory and
the pure configs (``builder_config()``, ``group_config()``) read nothing else.

Names derived from the settings (all carry the namespace and the versioned app id, so two
namespaces or two processor versions never share a consumer group or a changelog):

    app_id             "<ns>.rollstream-processor-v1"     faust app id = consumer group id
    changelogs         "<app_id>-rollouts-changelog", "<app_id>-groups-changelog"
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from rollstream.schemas.events import SampleMode
from rollstream.schemas.settings import NONE_FROM_ENV, CommonSettings
from rollstream.streams.core import AdvantageConfig, BuilderConfig, GroupConfig, SampleConfig

__all__ = ["ProcessorSettings"]

_S_TO_US = 1_000_000


class ProcessorSettings(CommonSettings):
    """The trajectory builder + group aggregator worker (ROLLSTREAM_PROC_* for its own)."""

    model_config = NONE_FROM_ENV

    proc_app_id: str = "rollstream-processor-v1"  # faust app id: consumer group, table topics
    # trajectory builder (BuilderConfig)
    proc_scorer: str = "default"  # partial-progress scorer: default or final_only
    proc_dedup_calls: bool = True  # merge calls with the same prompt + completion
    proc_inactivity_timeout_s: float = 600.0  # an idle open rollout closes as truncated
    proc_closed_retention_s: float = 3600.0  # closed-rollout tombstones (duplicate detection)
    proc_max_pending: int = 10_000  # out-of-order events held per rollout; more: DLQ
    # an event time further than this past real time moves no partition clock (books.py): a
    # producer with a clock ahead cannot time out the other rollouts and groups of its partition
    proc_max_clock_ahead_s: float | None = Field(30.0, ge=0.0, le=86_400.0)  # none: trust all
    # group aggregator (GroupConfig, SampleConfig, AdvantageConfig)
    proc_group_size: int | None = None  # when RolloutStarted.group_size is not set
    proc_group_timeout_s: float = 900.0  # a group without all rollouts closes after this
    proc_group_closed_retention_s: float = 3600.0  # closed-group tombstones (late trajectories)
    proc_sample_mode: Literal["path", "tree"] = "path"  # a sample per leaf path, or per tree
    proc_share_prefixes: bool = True  # calls beginning alike share tokens in the trie
    proc_adv_normalize_std: bool = True  # divide by the group's std (off: Dr. GRPO)
    proc_adv_leave_one_out: bool = False  # baseline: mean of the others (RLOO)
    proc_adv_eps: float = 1e-6  # added to the std
    proc_adv_std_ddof: int = 0  # 0: population std; 1: sample std
    proc_drop_zero_variance: bool = True  # DAPO: groups whose rewards all agree
    # shell
    proc_timer_interval_s: float = 1.0  # how often timeouts and evictions run
    proc_log_level: str = "info"  # debug, info, warning, error
    proc_event_loop: Literal["uvloop", "asyncio"] = "uvloop"  # asyncio if uvloop is missing
    proc_stats_interval_s: float = 30.0  # counters in the log this often (0: never)
    # faust / aiokafka tuning (docs/processors.md says why)
    proc_session_timeout_s: float = 6.0  # consumer group session
    proc_heartbeat_interval_s: float = 1.0  # consumer group heartbeat
    proc_rebalance_timeout_s: float = 6.0  # consumer group rebalance
    proc_commit_interval_s: float = 1.0  # offsets committed this often
    proc_request_timeout_s: float = 30.0  # Kafka request timeout
    proc_producer_linger_ms: float = 5.0  # producer linger
    proc_producer_batch_bytes: int = 1_048_576  # per partition (faust's default: 16 KiB)
    proc_producer_acks: Literal[-1, 0, 1] = -1  # -1: all replicas
    proc_max_message_bytes: int = 16_777_216  # largest record produced
    proc_fetch_max_bytes: int = 4_194_304  # per partition
    proc_standby_replicas: int = 0  # faust table standbys
    proc_stream_buffer_maxsize: int = 4096  # records a stream buffers

    # --- derived names ----------------------------------------------------------------------

    @property
    def app_id(self) -> str:
        return self.topics().name(self.proc_app_id)

    @property
    def data_dir(self) -> Path:
        return self.home / "processor" / self.app_id

    # --- pure configs -----------------------------------------------------------------------

    def max_clock_ahead_us(self) -> int | None:
        ahead = self.proc_max_clock_ahead_s
        return None if ahead is None else int(ahead * _S_TO_US)

    def builder_config(self) -> BuilderConfig:
        return BuilderConfig(
            inactivity_timeout_us=int(self.proc_inactivity_timeout_s * _S_TO_US),
            closed_retention_us=int(self.proc_closed_retention_s * _S_TO_US),
            max_pending=self.proc_max_pending,
            dedup=self.proc_dedup_calls,
            scorer=self.proc_scorer,
        )

    def group_config(self) -> GroupConfig:
        return GroupConfig(
            group_size=self.proc_group_size,
            timeout_us=int(self.proc_group_timeout_s * _S_TO_US),
            closed_retention_us=int(self.proc_group_closed_retention_s * _S_TO_US),
            advantage=AdvantageConfig(
                normalize_std=self.proc_adv_normalize_std,
                leave_one_out=self.proc_adv_leave_one_out,
                eps=self.proc_adv_eps,
                std_ddof=self.proc_adv_std_ddof,
                drop_zero_variance=self.proc_drop_zero_variance,
            ),
            samples=SampleConfig(
                mode=SampleMode(self.proc_sample_mode), share_prefixes=self.proc_share_prefixes
            ),
        )
