"""Which rollouts, and their events, page by page: the store side of a replay and of the
analytics server's ``/events`` API.

    RolloutFilter                               which rollouts (pure): ``matches(event)``,
                                                ``sql(database)``, JSON both ways
    rollout_page(client, db, filter, after, limit, codec) -> (records, last)
    count_rollouts(client, db, filter) -> (rollouts, events)

A selection is of *whole rollouts*: a rollout is selected when its RolloutStarted matches every
filter (started in [since, until), task, group, run_id, policy version, rollout id); then all
its events are, in seq order.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rollstream.consumers.store import chstore
from rollstream.schemas import Codec, Event, RolloutStarted

__all__ = ["RolloutFilter", "count_rollouts", "rollout_page"]


@dataclass(frozen=True, slots=True)
class RolloutFilter:
    """Which rollouts a replay takes, by their RolloutStarted. Empty fields do not filter."""

    since_us: int | None = None
    until_us: int | None = None
    task_ids: tuple[str, ...] = ()
    group_ids: tuple[str, ...] = ()
    run_ids: tuple[str, ...] = ()
    policy_versions: tuple[int, ...] = ()
    rollout_ids: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        return any(v not in (None, ()) for v in asdict(self).values())

    def matches(self, event: Event) -> bool:
        """Whether a rollout whose first event is ``event`` is selected."""
        body = event.body
        if not isinstance(body, RolloutStarted):
            return False
        checks = (
            self.since_us is None or event.ts >= self.since_us,
            self.until_us is None or event.ts < self.until_us,
            not self.task_ids or body.task_id in self.task_ids,
            not self.group_ids or body.group_id in self.group_ids,
            not self.run_ids or body.run_id in self.run_ids,
            not self.policy_versions or body.policy_version in self.policy_versions,
            not self.rollout_ids or event.rollout_id in self.rollout_ids,
        )
        return all(checks)

    def sql(self, database: str) -> tuple[str, dict[str, Any]]:
        """A SELECT of the selected rollout ids (may repeat), and its parameters."""
        db = chstore.check_identifier(database)
        if not self.active:
            return f"SELECT rollout_id FROM {db}.events", {}
        conds = ["source = 'started'"]
        params: dict[str, Any] = {}
        if self.since_us is not None:
            conds.append("ts >= fromUnixTimestamp64Micro({f_since:Int64})")
            params["f_since"] = self.since_us
        if self.until_us is not None:
            conds.append("ts < fromUnixTimestamp64Micro({f_until:Int64})")
            params["f_until"] = self.until_us
        for column, name, kind in (
            ("task_id", "task_ids", "String"),
            ("group_id", "group_ids", "String"),
            ("run_id", "run_ids", "String"),
            ("policy_version", "policy_versions", "Int64"),
            ("rollout_id", "rollout_ids", "String"),
        ):
            values = getattr(self, name)
            if values:
                conds.append(f"{column} IN {{f_{name}:Array({kind})}}")
                params[f"f_{name}"] = list(values)
        return f"SELECT rollout_id FROM {db}.rollouts WHERE {' AND '.join(conds)}", params

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> RolloutFilter:
        data = dict(data or {})
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown filter fields {sorted(unknown)}")
        kw: dict[str, Any] = {}
        for k, v in data.items():
            if k in ("since_us", "until_us"):
                kw[k] = None if v is None else int(v)
            elif k == "policy_versions":
                kw[k] = tuple(int(x) for x in v or ())
            else:
                kw[k] = tuple(str(x) for x in v or ())
        return cls(**kw)


def rollout_page(
    client: Any, database: str, flt: RolloutFilter, after: str | None, limit: int, codec: Codec
) -> tuple[list[bytes], str | None]:
    """Up to ``limit`` whole rollouts after rollout id ``after``, as (key, value) frames
    flattened (``[key1, value1, key2, value2, ...]``; values encoded with ``codec``), in
    (rollout_id, seq) order, and the cursor of the next page (None after the last page)."""
    if limit < 1:
        raise ValueError("limit must be positive")
    selection, params = flt.sql(database)
    ids = chstore.query(
        client,
        f"SELECT rollout_id FROM ({selection}) WHERE rollout_id > {{p_after:String}} "
        f"GROUP BY rollout_id ORDER BY rollout_id LIMIT {int(limit)}",
        {**params, "p_after": after or ""},
    ).column("rollout_id")
    if not ids:
        return [], None
    events = chstore.fetch_events(
        client, database=database, where="e.rollout_id IN {p_ids:Array(String)}",
        parameters={"p_ids": ids},
    )  # fmt: skip
    out: list[bytes] = []
    for event in events:
        out.append(event.rollout_id.encode())
        out.append(codec.encode(event))
    return out, (ids[-1] if len(ids) == limit else None)


def count_rollouts(client: Any, database: str, flt: RolloutFilter) -> tuple[int, int]:
    """(rollouts, events) a replay of ``flt`` from the store would publish."""
    selection, params = flt.sql(database)
    table = chstore.query(
        client,
        f"SELECT uniqExact(rollout_id), count() FROM {chstore.check_identifier(database)}.events "
        f"FINAL WHERE rollout_id IN ({selection})",
        params,
    )
    rollouts, events = table.rows[0]
    return int(rollouts), int(events)
