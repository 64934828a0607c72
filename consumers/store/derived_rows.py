"""Derived records (rebuilt trajectories, training samples, policy versions) mapped to ClickHouse
rows. Pure: no ClickHouse client. The events' mapper, the dispatch on the record type and the
row batch are in rows.py.

    Trajectory      -> trajectories, rollouts (source "trajectory", version last_seq * 4 + 2)
    Sample          -> samples (sizes and a content digest; the tokens live in llm_calls)
    PolicyVersion   -> policy_versions

Rows are tuples in the column order of ``tables.TABLES``; a record that cannot be stored raises
``RowError``.
"""

from __future__ import annotations

import hashlib

import numpy as np

from rollstream.consumers.errors import RowError
from rollstream.consumers.store.tables import MAX_TS_US, TableRows
from rollstream.schemas import PolicyVersion, Sample, Trajectory

__all__ = [
    "rows_for_policy_version",
    "rows_for_sample",
    "rows_for_trajectory",
    "sample_digest",
]


def _ts(value: int, what: str, kind: str) -> int:
    if not 0 <= value <= MAX_TS_US:
        raise RowError(f"{what} {value} is outside 0..{MAX_TS_US} microseconds", kind)
    return value


def rows_for_trajectory(
    traj: Trajectory, topic: str, partition: int, offset: int, *, timestamp_us: int = 0
) -> TableRows:
    """Rows of a rebuilt trajectory: ``trajectories`` (tree shape and rewards, not the token
    arrays, which llm_calls holds) and its ``rollouts`` summary (source "trajectory").
    ``ts`` is the rollout start, else its finish, else ``timestamp_us`` (the Kafka time)."""
    kind = "Trajectory"
    if not traj.rollout_id:
        raise RowError("empty rollout_id", kind)
    started = _ts(traj.started_ts, "started_ts", kind)
    finished = _ts(traj.finished_ts, "finished_ts", kind)
    ts = _ts(started or finished or timestamp_us, "ts", kind)
    nodes = traj.nodes
    completion_lens = np.fromiter((len(n.completion_ids) for n in nodes), np.uint32, len(nodes))
    num_completion = int(completion_lens.sum())
    kafka = (topic, partition, offset)
    common = (traj.task_id, traj.group_id, traj.run_id, traj.attempt, traj.group_size or 0)
    k, rewards = len(nodes), traj.rewards
    traj_row = (
        traj.rollout_id, ts, *common, traj.status, traj.error or "", traj.score,
        traj.score_source, traj.num_events, traj.last_seq, started, finished, k, num_completion,
        [n.call_id for n in nodes],
        [n.parent_call_id or "" for n in nodes],
        np.fromiter((n.prefix_len for n in nodes), np.int32, k),
        np.fromiter((len(n.prompt_tokens) for n in nodes), np.uint32, k),
        completion_lens,
        np.fromiter((n.policy_version for n in nodes), np.int64, k),
        [n.finish_reason for n in nodes],
        np.fromiter((r.value for r in rewards), np.float64, len(rewards)),
        [r.kind for r in rewards],
        [r.name for r in rewards],
        [r.at_call_id or "" for r in rewards],
        traj.metadata,
        *kafka,
    )  # fmt: skip

    policy = min((n.policy_version for n in nodes), default=0)
    rollout_row = (
        traj.rollout_id, "trajectory", max(traj.last_seq, 0) * 4 + 2, ts, *common, "", policy,
        traj.status, traj.error or "", traj.score, traj.num_events, len(nodes), num_completion,
        started, finished, *kafka,
    )  # fmt: skip
    return {"trajectories": [traj_row], "rollouts": [rollout_row]}


def sample_digest(sample: Sample) -> str:
    """A digest of the sample's token content (ids, mask, logprobs, tree, versions): two runs
    that produced identical samples have equal digests (replay checks compare them in SQL)."""
    h = hashlib.blake2b(digest_size=16)
    for arr in (
        sample.input_ids,
        sample.loss_mask,
        sample.behaviour_logprobs,
        sample.parent_indices,
        sample.token_policy_versions,
    ):
        h.update(len(arr).to_bytes(8, "little"))
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def rows_for_sample(
    sample: Sample, topic: str, partition: int, offset: int, *, timestamp_us: int
) -> TableRows:
    """Rows of a training sample. A sample has no time of its own: ``timestamp_us`` is the
    Kafka message time (when it became available to the trainer; staleness is measured then).
    Token arrays are not stored, only their sizes and a digest of their content."""
    kind = "Sample"
    if not sample.sample_id:
        raise RowError("empty sample_id", kind)
    if timestamp_us <= 0:
        raise RowError("a sample needs timestamp_us (its Kafka message time)", kind)
    versions = sample.policy_versions
    row = (
        sample.sample_id,
        sample.rollout_id,
        sample.group_id,
        sample.task_id,
        _ts(timestamp_us, "timestamp_us", kind),
        str(sample.mode),
        sample.advantage,
        sample.reward,
        sample.loss_weight,
        sample.policy_version,
        min(versions) if versions else sample.policy_version,
        versions,
        sample.leaf_id,
        sample.num_tokens,
        len(sample.input_ids),
        int(np.count_nonzero(sample.loss_mask)),
        sample_digest(sample),
        topic,
        partition,
        offset,
    )
    return {"samples": [row]}


def rows_for_policy_version(
    pv: PolicyVersion, topic: str, partition: int, offset: int
) -> TableRows:
    kind = "PolicyVersion"
    row = (
        pv.version,
        _ts(pv.ts, "ts", kind),
        pv.checkpoint_uri,
        pv.trainer_step,
        pv.samples_trained,
        pv.metrics,
        topic,
        partition,
        offset,
    )
    return {"policy_versions": [row]}
