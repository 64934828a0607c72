"""What the web UI's data endpoints (ui_api.py, ui_tree.py) share: the ``Query`` an endpoint
asks its I/O edge to run, the ``Result`` it gets back, the bounded-parameters base model, the
error a bad parameter raises, and the SQL fragments two endpoints read alike. Pure: no
ClickHouse client, no HTTP framework.

    AnalyticsError
    └── ParamError      a parameter is missing, unknown or out of bounds (answered 400)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from pydantic import BaseModel, ConfigDict, Field

from rollstream.consumers.errors import AnalyticsError

__all__ = [
    "MAX_CALLS",
    "MAX_ID",
    "MAX_TOOLS",
    "MAX_TOOL_TEXT",
    "ROLLOUT_COLUMNS",
    "SAMPLE_COLUMNS",
    "STATUSES",
    "Ask",
    "Id",
    "ParamError",
    "Params",
    "Query",
    "Result",
    "dicts",
    "num",
    "samples_query",
]

MAX_ID = 256  # rollout, group, task, job and call ids
MAX_CALLS = 20_000  # LLM calls read per rollout
MAX_TOOLS = 5_000
MAX_TOOL_TEXT = 2_000  # characters of a tool call's arguments and of its result shown
STATUSES = ("running", "completed", "failed", "timeout", "aborted", "truncated")
Id = Field(default="", max_length=MAX_ID)


class ParamError(AnalyticsError):
    """A request parameter is missing, unknown or out of bounds (answered 400, naming it)."""


class Query(NamedTuple):
    sql: str  # ``{db}`` already replaced; ``{name:Type}`` bound server-side from params
    params: dict[str, Any]


class Result(Protocol):
    """What running a Query gives (chstore.Table): column names and row tuples."""

    columns: tuple[str, ...]
    rows: list[tuple[Any, ...]]


Ask = Callable[[Query], Result]


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def dicts(result: Result) -> list[dict[str, Any]]:
    return [dict(zip(result.columns, row, strict=True)) for row in result.rows]


def num(value: Any) -> Any:
    """Floats that JSON can carry (NaN and infinities become None)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


ROLLOUT_COLUMNS = """r.rollout_id AS rollout_id, r.task_id AS task_id, r.group_id AS group_id,
       j.job AS job_id, r.status AS status, r.policy_version AS policy_version,
       f.reward AS reward, r.score AS score, r.num_llm_calls AS llm_calls,
       r.num_completion_tokens AS completion_tokens, r.started_ts AS started_ts,
       r.finished_ts AS finished_ts"""


SAMPLE_COLUMNS = """sample_id, rollout_id, leaf_id, mode, advantage, reward, loss_weight,
       num_tokens, input_len, num_loss_tokens, policy_version, min_policy_version"""


def samples_query(db: str, *, rollout: str = "", group: str = "") -> Query:
    column, value = ("rollout_id", rollout) if rollout else ("group_id", group)
    return Query(
        f"SELECT {SAMPLE_COLUMNS} FROM {db}.samples FINAL WHERE {column} = {{key:String}} "
        f"ORDER BY rollout_id, sample_id LIMIT {MAX_CALLS}",
        {"key": value},
    )
