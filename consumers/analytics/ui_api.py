"""The web UI's data endpoints (``GET /ui/api/<name>``): bounded parameters, the SQL each one
runs, and the JSON it answers. Pure: no ClickHouse client, no HTTP framework; server.py runs an
endpoint with a function that executes a ``Query`` (its I/O edge).

    ENDPOINTS[name] = Endpoint(name, Params model, run(params, database, ask) -> JSON dict)
    parse_params(endpoint, raw query string pairs) -> the params model (ParamError names the field)

Endpoints (the dashboard and the training page read canned views, ``/reports/<view>``):
- ``filters``: the values the rollout browser offers (jobs, tasks, statuses, policy versions);
- ``rollouts``: a page of rollouts filtered by job, task, group, status, reward range, policy
  version; each with its reward (sum of final rewards, reports.py's definition), score, counts;
- ``group``: a group's rollouts side by side with their samples' advantages;
- ``trajectory`` and ``tokens``: the tree viewer's (ui_tree.py);
- ``throughput``: LLM calls and generated tokens per minute over the last ``minutes`` before
  the newest call, and tokens/s over its last 5 minutes (the dashboard's tokens/s).
The dashboard's consumer lag is read from Kafka, not from the store (server.py, ``/ui/api/lag``).
What the endpoints share (``Query``, ``ParamError``, the params base) is in ui_query.py.

Every parameter has bounds (pydantic ``Field``); a value outside them is ``ParamError`` (400).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationError

from rollstream.consumers.analytics.ui_query import (
    MAX_ID,
    ROLLOUT_COLUMNS,
    STATUSES,
    Ask,
    Id,
    ParamError,
    Params,
    Query,
    Result,
    dicts,
    num,
    samples_query,
)
from rollstream.consumers.analytics.ui_tree import (
    TokensParams,
    TrajectoryParams,
    node_links,
    path_tokens,
    run_tokens,
    run_trajectory,
)

__all__ = [
    "ENDPOINTS",
    "Endpoint",
    "FiltersParams",
    "GroupParams",
    "ParamError",
    "Query",
    "RolloutsParams",
    "ThroughputParams",
    "TokensParams",
    "TrajectoryParams",
    "node_links",
    "parse_params",
    "path_tokens",
    "rollouts_query",
]


class FiltersParams(Params):
    limit: int = Field(default=500, ge=1, le=5_000)


class RolloutsParams(Params):
    job: str = Id
    task: str = Id
    group: str = Id
    status: Literal["", *STATUSES] = ""  # type: ignore[valid-type]
    min_reward: float | None = Field(default=None, ge=-1e12, le=1e12)
    max_reward: float | None = Field(default=None, ge=-1e12, le=1e12)
    policy_version: int | None = Field(default=None, ge=-1, le=2**53)
    limit: int = Field(default=100, ge=1, le=1_000)
    offset: int = Field(default=0, ge=0, le=10_000_000)


class ThroughputParams(Params):
    minutes: int = Field(default=60, ge=1, le=1_440)


class GroupParams(Params):
    group: str = Field(min_length=1, max_length=MAX_ID)
    limit: int = Field(default=256, ge=1, le=1_000)


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str
    params: type[Params]
    run: Callable[[Any, str, Ask], dict[str, Any]]


def parse_params(endpoint: Endpoint, raw: Iterable[tuple[str, str]]) -> Any:
    """The endpoint's params from query-string pairs; empty values count as absent."""
    data: dict[str, str] = {}
    for name, value in raw:
        if name in data:
            raise ParamError(f"{name}: given twice")
        if value != "":
            data[name] = value
    try:
        return endpoint.params.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        field = ".".join(str(x) for x in err.get("loc", ())) or "parameters"
        raise ParamError(f"{field}: {err.get('msg', 'invalid')}") from exc


# --- filters ----------------------------------------------------------------------------------


def filters_queries(p: FiltersParams, db: str) -> dict[str, Query]:
    lim = {"lim": p.limit}
    return {
        "tasks": Query(f"SELECT DISTINCT task_id AS v FROM {db}.rollout_status "
                       "ORDER BY v LIMIT {lim:UInt32}", lim),
        "statuses": Query(f"SELECT DISTINCT status AS v FROM {db}.rollout_status "
                          "ORDER BY v LIMIT {lim:UInt32}", lim),
        "policy_versions": Query(f"SELECT DISTINCT policy_version AS v FROM {db}.rollout_status "
                                 "ORDER BY v LIMIT {lim:UInt32}", lim),
        "jobs": Query(f"SELECT DISTINCT job_id AS v FROM {db}.stages WHERE job_id != '' "
                      "ORDER BY v LIMIT {lim:UInt32}", lim),
    }  # fmt: skip


def run_filters(p: FiltersParams, db: str, ask: Ask) -> dict[str, Any]:
    return {name: [r[0] for r in ask(q).rows] for name, q in filters_queries(p, db).items()}


# --- rollouts ---------------------------------------------------------------------------------


# a page cut from rollout_status alone: reward and job come from page_extras_queries
_PAGE_COLUMNS = ROLLOUT_COLUMNS.replace("j.job AS", "'' AS").replace("f.reward AS", "0.0 AS")


def _joined(p: RolloutsParams) -> bool:
    """Whether a filter reads the joined rewards or jobs (else the page needs no join)."""
    return bool(p.job) or p.min_reward is not None or p.max_reward is not None


def rollouts_query(p: RolloutsParams, db: str) -> Query:
    """A page of rollouts (newest start first) and the count of all that match, as ``total``.
    Unless a filter reads the rewards or the jobs, the page is cut from rollout_status alone
    (reward 0.0, job ''), and ``page_extras_queries`` read the page's rewards and jobs: the
    joins then read the page's rollouts, not all of them."""
    conds: list[str] = []
    params: dict[str, Any] = {"lim": p.limit, "off": p.offset}
    for column, value, name in (
        ("r.task_id", p.task, "task"),
        ("r.group_id", p.group, "grp"),
        ("r.status", p.status, "status"),
        ("j.job", p.job, "job"),
    ):
        if value:
            conds.append(f"{column} = {{{name}:String}}")
            params[name] = value
    if p.policy_version is not None:
        conds.append("r.policy_version = {pv:Int64}")
        params["pv"] = p.policy_version
    if p.min_reward is not None:
        conds.append("f.reward >= {rmin:Float64}")
        params["rmin"] = p.min_reward
    if p.max_reward is not None:
        conds.append("f.reward <= {rmax:Float64}")
        params["rmax"] = p.max_reward
    where = f"WHERE {' AND '.join(conds)}" if conds else ""
    if not _joined(p):
        return Query(
            f"SELECT {_PAGE_COLUMNS}, count() OVER () AS total\nFROM {db}.rollout_status AS r\n"
            f"{where}\nORDER BY r.started_ts DESC, r.rollout_id\n"
            "LIMIT {lim:UInt32} OFFSET {off:UInt64}",
            params,
        )
    sql = f"""WITH finals AS (
    SELECT rollout_id, sum(value) AS reward FROM {db}.rewards FINAL
    WHERE kind = 'final' GROUP BY rollout_id
),
jobs AS (
    SELECT rollout_id, any(job_id) AS job FROM {db}.stages
    WHERE job_id != '' GROUP BY rollout_id
)
SELECT {ROLLOUT_COLUMNS}, count() OVER () AS total
FROM {db}.rollout_status AS r
LEFT JOIN finals AS f ON f.rollout_id = r.rollout_id
LEFT JOIN jobs AS j ON j.rollout_id = r.rollout_id
{where}
ORDER BY r.started_ts DESC, r.rollout_id
LIMIT {{lim:UInt32}} OFFSET {{off:UInt64}}"""
    return Query(sql, params)


def _rollout_rows(result: Result) -> tuple[list[dict[str, Any]], int]:
    rows = dicts(result)
    total = int(rows[0].pop("total")) if rows else 0
    for r in rows[1:]:
        r.pop("total", None)
    return [{k: num(v) for k, v in r.items()} for r in rows], total


def page_extras_queries(db: str, ids: list[str]) -> tuple[Query, Query]:
    """The rewards (sum of final rewards) and jobs of the rollouts ``ids``: (rollout_id, value)."""
    key = {"ids": ids}
    return (
        Query(f"SELECT rollout_id, sum(value) FROM {db}.rewards FINAL WHERE kind = 'final' "
              "AND rollout_id IN {ids:Array(String)} GROUP BY rollout_id", key),
        Query(f"SELECT rollout_id, any(job_id) FROM {db}.stages WHERE job_id != '' "
              "AND rollout_id IN {ids:Array(String)} GROUP BY rollout_id", key),
    )  # fmt: skip


def _page(p: RolloutsParams, db: str, ask: Ask) -> tuple[list[dict[str, Any]], int]:
    rows, total = _rollout_rows(ask(rollouts_query(p, db)))
    if rows and not _joined(p):
        finals, jobs = (
            dict(ask(q).rows) for q in page_extras_queries(db, [r["rollout_id"] for r in rows])
        )
        for r in rows:
            r["reward"] = num(finals.get(r["rollout_id"], 0.0))
            r["job_id"] = jobs.get(r["rollout_id"], "")
    return rows, total


def run_rollouts(p: RolloutsParams, db: str, ask: Ask) -> dict[str, Any]:
    rows, total = _page(p, db, ask)
    return {"total": total, "offset": p.offset, "limit": p.limit, "rollouts": rows}


# --- group ------------------------------------------------------------------------------------


def run_group(p: GroupParams, db: str, ask: Ask) -> dict[str, Any]:
    rows, total = _page(RolloutsParams(group=p.group, limit=p.limit), db, ask)
    rows.sort(key=lambda r: r["rollout_id"])
    samples = [
        {k: num(v) for k, v in s.items()} for s in dicts(ask(samples_query(db, group=p.group)))
    ]
    by_rollout: dict[str, list[dict[str, Any]]] = {}
    for s in samples:
        by_rollout.setdefault(s["rollout_id"], []).append(s)
    for r in rows:
        own = by_rollout.get(r["rollout_id"], [])
        r["samples"] = own
        # the rollout-level advantage: one value per rollout, carried by each of its samples
        r["advantage"] = own[0]["advantage"] if own else None
    rewards = [r["reward"] for r in rows if r["status"] != "running" and r["reward"] is not None]
    mean = sum(rewards) / len(rewards) if rewards else None
    return {"group_id": p.group, "total": total, "mean_reward": mean, "rollouts": rows}


# --- throughput -------------------------------------------------------------------------------

RECENT_S = 300  # the window of the dashboard's tokens/s, ending at the newest call


def throughput_queries(p: ThroughputParams, db: str) -> tuple[Query, Query]:
    """Per minute (calls, generated tokens = completion ids recorded, prompt tokens, p50 latency)
    over the last ``minutes`` before the newest call; and the tokens of its last RECENT_S.
    Relative to the newest call, so a replayed or finished run shows its own last hour. Each
    call counts once: rows are grouped by event_id (a re-delivered event is a duplicate row
    until ClickHouse merges), which reads only the window's rows where FINAL would read its
    partitions whole."""
    calls = f"""SELECT event_id, any(ts) AS at, any(completion_ids.size0) AS completion,
           any(prompt_len) AS prompt, any(latency_ms) AS latency
    FROM {db}.llm_calls
    WHERE ts > (SELECT max(ts) FROM {db}.llm_calls) - toIntervalSecond({{window:UInt32}})
    GROUP BY event_id"""
    return (
        Query(f"""SELECT toStartOfMinute(at) AS minute, count() AS calls,
       sum(completion) AS completion_tokens, sum(prompt) AS prompt_tokens,
       quantile(0.5)(latency) AS p50_latency_ms
FROM ({calls})
GROUP BY minute ORDER BY minute""", {"window": p.minutes * 60}),
        Query(f"""SELECT count() AS calls, sum(completion) AS completion_tokens,
       (SELECT max(ts) FROM {db}.llm_calls) AS last
FROM ({calls})""", {"window": RECENT_S}),
    )  # fmt: skip


def run_throughput(p: ThroughputParams, db: str, ask: Ask) -> dict[str, Any]:
    per_minute, recent = throughput_queries(p, db)
    rows = [{k: num(v) for k, v in r.items()} for r in dicts(ask(per_minute))]
    (calls, tokens, last), *_ = ask(recent).rows or [(0, 0, None)]
    empty = not calls
    return {
        "minutes": rows,
        "last_call": None if empty else num(last),
        "recent_s": RECENT_S,
        "recent_calls": int(calls or 0),
        "recent_tokens": int(tokens or 0),
        "tokens_per_s": None if empty else (tokens or 0) / RECENT_S,
    }


ENDPOINTS: dict[str, Endpoint] = {
    e.name: e
    for e in (
        Endpoint("filters", FiltersParams, run_filters),
        Endpoint("rollouts", RolloutsParams, run_rollouts),
        Endpoint("group", GroupParams, run_group),
        Endpoint("trajectory", TrajectoryParams, run_trajectory),
        Endpoint("tokens", TokensParams, run_tokens),
        Endpoint("throughput", ThroughputParams, run_throughput),
    )
}
