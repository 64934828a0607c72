"""Builder and aggregator states as bytes, for a faust table (no pickle).

Layout: ``b"RSST"``, a format version byte, a kind byte (``R`` RolloutState, ``G`` GroupState),
the header length and the CRC-32 of everything after the prefix (uint32 little-endian each),
the header as JSON (sorted keys, compact), then one blob holding every token array back to
back. In the header an array is ``{"$b": [offset,
length]}`` into the blob; records use their Avro dict form (``to_avro``/``from_avro``), so
token arrays are their packed little-endian bytes. Equal states give equal bytes, and restored
arrays are read-only views of the bytes (nothing is copied token by token).
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

from rollstream.schemas.events import (
    Event,
    RewardRecord,
    RolloutStarted,
    RolloutStatus,
    Trajectory,
    TrajectoryNode,
)

from .errors import StateFormatError
from .groups import GroupState
from .trajectory import Phase, RolloutState
from .tree import CallTree

__all__ = ["state_from_bytes", "state_to_bytes"]

_MAGIC = b"RSST"
_VERSION = 1
_HEAD = struct.Struct("<4sBcII")


def state_to_bytes(state: RolloutState | GroupState) -> bytes:
    """Serialise a builder or aggregator state (deterministic)."""
    if isinstance(state, RolloutState):
        kind, header = b"R", _rollout_header(state)
    elif isinstance(state, GroupState):
        kind, header = b"G", _group_header(state)
    else:
        raise TypeError(f"not a stream state: {type(state).__name__}")
    blob = bytearray()

    def refs(value: Any) -> Any:
        if isinstance(value, bytes | bytearray | memoryview):
            ref = {"$b": [len(blob), len(value)]}
            blob.extend(value)
            return ref
        if isinstance(value, dict):
            return {key: refs(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [refs(item) for item in value]
        return value

    text = json.dumps(refs(header), sort_keys=True, separators=(",", ":")).encode()
    crc = zlib.crc32(blob, zlib.crc32(text))
    return _HEAD.pack(_MAGIC, _VERSION, kind, len(text), crc) + text + bytes(blob)


def state_from_bytes(data: bytes) -> RolloutState | GroupState:
    """Inverse of ``state_to_bytes``; raises StateFormatError on anything else."""
    try:
        magic, version, kind, size, crc = _HEAD.unpack_from(data)
        if magic != _MAGIC or version != _VERSION:
            raise StateFormatError(f"not a stream state (magic {magic!r}, version {version})")
        if zlib.crc32(memoryview(data)[_HEAD.size :]) != crc:
            raise StateFormatError(f"checksum mismatch ({len(data)} bytes)")
        start = _HEAD.size + size
        blob = memoryview(data)[start:]

        def deref(obj: dict[str, Any]) -> Any:
            ref = obj.get("$b")
            if len(obj) == 1 and isinstance(ref, list):
                offset, length = ref
                return blob[offset : offset + length]
            return obj

        header = json.loads(bytes(data[_HEAD.size : start]), object_hook=deref)
        if kind == b"R":
            return _rollout_from(header)
        if kind == b"G":
            return _group_from(header)
        raise StateFormatError(f"unknown state kind {kind!r}")
    except StateFormatError:
        raise
    except Exception as exc:
        raise StateFormatError(f"corrupt state ({len(data)} bytes): {exc!r}") from exc


def _rollout_header(state: RolloutState) -> dict[str, Any]:
    return {
        "rollout_id": state.rollout_id,
        "phase": str(state.phase),
        "next_seq": state.next_seq,
        "event_ids": state.event_ids,
        "pending": [state.pending[seq].to_avro() for seq in sorted(state.pending)],
        "refused_seqs": sorted(state.refused_seqs),
        "last_ts": state.last_ts,
        "duplicates": state.duplicates,
        "started": None if state.started is None else state.started.to_avro(),
        "started_ts": state.started_ts,
        "nodes": [node.to_avro() for node in state.tree.nodes.values()],
        "aliases": state.tree.aliases,
        "rewards": [reward.to_avro() for reward in state.rewards],
        "branches": state.branches,
        "error": state.error,
        "status": None if state.status is None else str(state.status),
    }


def _rollout_from(h: dict[str, Any]) -> RolloutState:
    pending = [Event.from_avro(e) for e in h["pending"]]
    return RolloutState(
        rollout_id=h["rollout_id"],
        phase=Phase(h["phase"]),
        next_seq=h["next_seq"],
        event_ids=h["event_ids"],
        pending={event.seq: event for event in pending},
        refused_seqs=set(h["refused_seqs"]),
        last_ts=h["last_ts"],
        duplicates=h["duplicates"],
        started=None if h["started"] is None else RolloutStarted.from_avro(h["started"]),
        started_ts=h["started_ts"],
        tree=CallTree.from_nodes([TrajectoryNode.from_avro(n) for n in h["nodes"]], h["aliases"]),
        rewards=[RewardRecord.from_avro(r) for r in h["rewards"]],
        branches=h["branches"],
        error=h["error"],
        status=None if h["status"] is None else RolloutStatus(h["status"]),
    )


def _group_header(state: GroupState) -> dict[str, Any]:
    return {
        "group_id": state.group_id,
        "trajectories": [t.to_avro() for t in state.trajectories.values()],
        "expected_size": state.expected_size,
        "opened_ts": state.opened_ts,
        "closed": state.closed,
        "closed_rollouts": state.closed_rollouts,
        "duplicates": state.duplicates,
    }


def _group_from(h: dict[str, Any]) -> GroupState:
    trajectories = [Trajectory.from_avro(t) for t in h["trajectories"]]
    return GroupState(
        group_id=h["group_id"],
        trajectories={t.rollout_id: t for t in trajectories},
        expected_size=h["expected_size"],
        opened_ts=h["opened_ts"],
        closed=h["closed"],
        closed_rollouts=h["closed_rollouts"],
        duplicates=h["duplicates"],
    )
