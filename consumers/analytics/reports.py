"""Canned analytics views: SQL over the store's tables, each giving a small table.

The SQL is plain strings (``{db}`` is the namespace's database, ``{name:Type}`` are server-side
query parameters); ``run_report`` runs one through a client, ``plot`` draws the curve and
histogram views with matplotlib (Agg).

Definitions shared by the views:
- a rollout is *finished* once its status (view ``rollout_status``) is not ``running``;
- its *reward* is the sum of its ``final`` Reward events (0 when it has none);
- it *passes* when reward >= ``pass_threshold`` (default 1.0); a failure is a finished rollout
  that does not pass;
- its policy version is the one its RolloutStarted names;
- pass@k is the unbiased estimator 1 - C(n-c, k) / C(n, k) over a task's n finished rollouts
  with c passes (NaN when n < k);
- *staleness* of a sample: the newest policy version published (policy_versions.ts) at the
  time the sample reached the samples topic, minus the oldest policy version that produced
  any of its tokens (min_policy_version). Version 0 is the initial weights, published at time
  0, so it is the staleness the trainer sees if it trains the sample as soon as it arrives.
- a *trainer step* (view ``train_steps``) is one published policy version with the metrics
  the trainer recorded for it (NaN where it recorded none);
- a *stage* (view ``stages``) is one StageEvent pair of the rollout service (init, run, eval);
  its duration is the finished event's ``duration_ms``, its outcome the finished status.
Tables are read with FINAL (or idempotent aggregates), so raw duplicates never count twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clickhouse_connect.driver.client import Client

from rollstream.consumers.store.chstore import DEFAULT_DATABASE, Table, check_identifier, query

__all__ = ["VIEWS", "Param", "View", "plot", "render_sql", "run_report", "run_reports"]

_FINISHED = """
finals AS (
    SELECT rollout_id, sum(value) AS reward
    FROM {db}.rewards FINAL
    WHERE kind = 'final'
    GROUP BY rollout_id
),
finished AS (
    SELECT r.rollout_id AS rollout_id, r.task_id AS task_id, r.policy_version AS policy_version,
           r.status AS status, f.reward AS reward,
           f.reward >= {pass_threshold:Float64} AS passed
    FROM {db}.rollout_status AS r
    LEFT JOIN finals AS f ON f.rollout_id = r.rollout_id
    WHERE r.status != 'running'
)"""


@dataclass(frozen=True, slots=True)
class Param:
    type: str  # ClickHouse type of the query parameter
    default: Any


@dataclass(frozen=True, slots=True)
class View:
    name: str
    title: str
    sql: str
    params: dict[str, Param] = field(default_factory=dict)
    chart: str | None = None  # "line" or "bar"
    x: str = ""
    y: tuple[str, ...] = ()


_THRESHOLD = {"pass_threshold": Param("Float64", 1.0)}

VIEWS: dict[str, View] = {
    v.name: v
    for v in (
        View(
            "reward_by_policy",
            "Reward and pass rate per policy version",
            f"""WITH {_FINISHED}
SELECT policy_version, count() AS rollouts, avg(reward) AS mean_reward,
       avg(passed) AS pass_rate
FROM finished
GROUP BY policy_version
ORDER BY policy_version""",
            _THRESHOLD,
            "line",
            "policy_version",
            ("mean_reward", "pass_rate"),
        ),
        View(
            "pass_at_k",
            "pass@1 and pass@k per task",
            f"""WITH {_FINISHED},
per_task AS (
    SELECT task_id, toInt64(count()) AS n, toInt64(countIf(passed)) AS c
    FROM finished
    GROUP BY task_id
)
SELECT task_id, n AS rollouts, c AS passes, c / n AS pass_at_1,
       multiIf(n < {{k:UInt32}}, nan, c = 0, 0., n - c < {{k:UInt32}}, 1.,
               1. - arrayProduct(arrayMap(i -> 1. - {{k:UInt32}} / i, range(n - c + 1, n + 1))))
           AS pass_at_k
FROM per_task
ORDER BY task_id""",
            {**_THRESHOLD, "k": Param("UInt32", 5)},
        ),
        View(
            "tool_stats",
            "Tool calls: error rate and latency per tool",
            """SELECT name AS tool, count() AS calls, countIf(is_error) AS errors,
       avg(is_error) AS error_rate, avg(duration_ms) AS mean_ms,
       quantileExactInclusive(0.5)(duration_ms) AS p50_ms,
       quantileExactInclusive(0.95)(duration_ms) AS p95_ms
FROM {db}.tool_calls FINAL
GROUP BY tool
ORDER BY calls DESC, tool""",
            chart="bar",
            x="tool",
            y=("error_rate",),
        ),
        View(
            "tokens_per_rollout",
            "LLM calls and tokens per finished rollout, per policy version",
            """WITH per_rollout AS (
    -- rollout_tokens (migration 0004): one row per rollout under FINAL, with duplicate-proof
    -- states fed by materialized views; no join and no FINAL over llm_calls (the join of
    -- llm_calls FINAL with rollout_status took 1.0-1.2 s over 10M events)
    SELECT finalizeAggregation(policy_version) AS policy_version,
           finalizeAggregation(calls) AS c
    FROM {db}.rollout_tokens FINAL
    WHERE seen = 1 AND finalizeAggregation(finished) = 1
),
t AS (
    SELECT policy_version, toUInt64(length(c)) AS calls,
           toUInt64(arraySum(x -> x.3, c)) AS completion,
           toUInt64(arraySum(x -> x.4, c)) AS prompt_delta
    FROM per_rollout
)
SELECT policy_version, count() AS rollouts,
       avg(t.calls) AS mean_llm_calls, avg(t.completion) AS mean_completion_tokens,
       quantileExactInclusive(0.5)(t.completion) AS p50_completion_tokens,
       quantileExactInclusive(0.9)(t.completion) AS p90_completion_tokens,
       avg(t.prompt_delta) AS mean_prompt_delta_tokens,
       avg(t.completion + t.prompt_delta) AS mean_unique_tokens
FROM t
GROUP BY policy_version
ORDER BY policy_version""",
            {},
            "line",
            "policy_version",
            ("mean_completion_tokens",),
        ),
        View(
            "llm_latency",
            "LLM call latency percentiles per backend",
            """SELECT backend, count() AS calls, avg(latency_ms) AS mean_ms,
       quantileExactInclusive(0.5)(latency_ms) AS p50_ms,
       quantileExactInclusive(0.9)(latency_ms) AS p90_ms,
       quantileExactInclusive(0.99)(latency_ms) AS p99_ms,
       max(latency_ms) AS max_ms
FROM {db}.llm_calls FINAL
GROUP BY backend
ORDER BY backend""",
            chart="bar",
            x="backend",
            y=("p50_ms", "p90_ms", "p99_ms"),
        ),
        View(
            "stages",
            "Rollout-service stages per job: outcomes and duration percentiles",
            """-- stages (migration 0005): StageEvent rows; durations are of finished stages only
SELECT job_id, stage, countIf(phase = 'started') AS started,
       countIf(phase = 'finished') AS finished,
       countIf(phase = 'finished' AND status = 'failed') AS failed,
       countIf(phase = 'finished' AND status = 'timeout') AS timed_out,
       avgIf(duration_ms, phase = 'finished') AS mean_ms,
       quantileExactInclusiveIf(0.5)(duration_ms, phase = 'finished') AS p50_ms,
       quantileExactInclusiveIf(0.9)(duration_ms, phase = 'finished') AS p90_ms,
       quantileExactInclusiveIf(0.99)(duration_ms, phase = 'finished') AS p99_ms,
       maxIf(duration_ms, phase = 'finished') AS max_ms
FROM {db}.stages FINAL
GROUP BY job_id, stage
ORDER BY job_id, indexOf(['init', 'run', 'eval'], stage), stage""",
        ),
        View(
            "staleness",
            "Sample staleness (policy versions behind when available to the trainer)",
            """SELECT pv.version - s.min_policy_version AS staleness, count() AS samples,
       count() / sum(count()) OVER () AS share
FROM (SELECT min_policy_version, ts, 0 AS k FROM {db}.samples FINAL) AS s
ASOF LEFT JOIN (SELECT version, ts, 0 AS k FROM {db}.policy_versions FINAL) AS pv
    ON s.k = pv.k AND s.ts >= pv.ts
GROUP BY staleness
ORDER BY staleness""",
            chart="bar",
            x="staleness",
            y=("samples",),
        ),
        View(
            "rollouts_by_status",
            "Rollouts by status",
            """SELECT status, count() AS rollouts, count() / sum(count()) OVER () AS share
FROM {db}.rollout_status
GROUP BY status
ORDER BY rollouts DESC, status""",
            chart="bar",
            x="status",
            y=("rollouts",),
        ),
        View(
            "train_steps",
            "Trainer steps: loss, clip fraction, approx KL, entropy, grad norm, step time",
            """-- train_steps (migration 0006): one row per published policy version; a metric the
-- trainer did not record is NaN
SELECT policy_version, trainer_step, ts, samples_trained, loss, clip_frac, approx_kl, entropy,
       grad_norm, step_time_s, batch_samples, batch_tokens, lr, stale_dropped, dlq
FROM {db}.train_steps
ORDER BY policy_version
LIMIT {limit:UInt32}""",
            {"limit": Param("UInt32", 10_000)},
            "line",
            "policy_version",
            ("loss", "clip_frac", "approx_kl"),
        ),
        View(
            "top_failing_tasks",
            "Tasks with the most failed rollouts",
            f"""WITH {_FINISHED}
SELECT task_id, count() AS rollouts, countIf(NOT passed) AS failures,
       failures / rollouts AS fail_rate, avg(reward) AS mean_reward
FROM finished
GROUP BY task_id
HAVING failures > 0
ORDER BY failures DESC, fail_rate DESC, task_id
LIMIT {{limit:UInt32}}""",
            {**_THRESHOLD, "limit": Param("UInt32", 10)},
        ),
    )
}


def render_sql(view: str, database: str = DEFAULT_DATABASE) -> str:
    """The view's SQL for ``database`` (query parameters still to bind)."""
    return VIEWS[view].sql.replace("{db}", check_identifier(database))


def run_report(
    client: Client, view: str, *, database: str = DEFAULT_DATABASE, **params: Any
) -> Table:
    """Run one view; ``params`` override its defaults (unknown names are an error)."""
    spec = VIEWS[view]
    unknown = set(params) - set(spec.params)
    if unknown:
        raise ValueError(f"view {view} takes {sorted(spec.params)}, not {sorted(unknown)}")
    values = {name: params.get(name, p.default) for name, p in spec.params.items()}
    return query(client, render_sql(view, database), values)


def run_reports(
    client: Client,
    views: list[str] | None = None,
    *,
    database: str = DEFAULT_DATABASE,
    **params: Any,
) -> dict[str, Table]:
    """Run several views (all by default); each takes the ``params`` it declares."""
    out: dict[str, Table] = {}
    for name in views or list(VIEWS):
        own = {k: v for k, v in params.items() if k in VIEWS[name].params}
        out[name] = run_report(client, name, database=database, **own)
    return out


def plot(view: str, table: Table, path: str | Path) -> Path:
    """Draw a line or bar chart of a view's result into ``path`` (PNG, SVG, ...)."""
    spec = VIEWS[view]
    if spec.chart is None:
        raise ValueError(f"view {view} has no chart")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        xs = [str(x) if spec.chart == "bar" else x for x in table.column(spec.x)]
        width = 0.8 / len(spec.y)
        for i, name in enumerate(spec.y):
            ys = table.column(name)
            if spec.chart == "line":
                ax.plot(xs, ys, marker="o", label=name)
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            else:
                pos = [j + (i - (len(spec.y) - 1) / 2) * width for j in range(len(xs))]
                ax.bar(pos, ys, width=width, label=name)
        if spec.chart == "bar":
            ax.set_xticks(range(len(xs)), xs, rotation=30 if len(xs) > 6 else 0)
        ax.set_xlabel(spec.x)
        ax.set_title(spec.title)
        if len(spec.y) > 1:
            ax.legend()
        else:
            ax.set_ylabel(spec.y[0])
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out)
    finally:
        plt.close(fig)
    return out
