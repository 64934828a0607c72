"""ClickHouse store throughput and report latency (chDB, in process).

1. LlmCall events with --tokens-token arrays (prompt_delta, completion_ids, logprobs): our
   path (typed Event -> rows.RowBatch -> chstore.insert_batch, Arrow, dedup tokens) against a
   bare clickhouse-connect ``client.insert`` of the same rows (arrays as Python lists, built
   outside the timer) into the same tables, in the same run. Target: ours >= 0.8x bare.
2. Small events (tool calls, rewards, branches, starts/finishes): rows/s through our path.
   Target: >= 100k rows/s.
3. Each canned report's latency over --report-events generated events (rollouts of ~12
   events, samples, policy versions): best (``report_ms``) and median of --repeat runs.
   --reports-only --path DIR reuses data loaded earlier, after applying any migration added
   since (a backfill, e.g. 0004's per-rollout states). The dashboard of the web UI reads
   DASHBOARD_VIEWS of them (``dashboard_views_ms_median_sum``: their medians added up).
4. Over the same data, the web UI's data endpoints (ui_api.py: the rollout browser's filters
   and pages, a group, a rollout's tree and tokens) as the pages call them: ``ui_ms`` (best)
   and ``ui_ms_median`` (``throughput`` is the dashboard's).
Optional --codecs: compressed bytes per token of candidate codecs on token ids from a BPE
tokenizer trained here on the Python standard library (the codec choice in the DDL).

Prints one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from rollstream.consumers.analytics import reports, ui_api
from rollstream.consumers.store import chstore
from rollstream.consumers.store.migrations import apply_migrations
from rollstream.consumers.store.rows import RowBatch
from rollstream.consumers.store.tables import COLUMNS
from rollstream.schemas import (
    Branch,
    Event,
    LlmCall,
    PolicyVersion,
    Reward,
    RolloutFinished,
    RolloutStarted,
    Sample,
    StageEvent,
    StageName,
    StagePhase,
    ToolCall,
    Usage,
)

T0 = 1_735_689_600_000_000  # 2025-01-01 UTC, microseconds
TOOLS = ("bash", "python", "read_file", "write_file", "search")
TOOL_ERROR = {"bash": 0.2, "python": 0.1, "read_file": 0.02, "write_file": 0.05, "search": 0.0}
STATUSES = ("completed", "failed", "timeout", "aborted")
STATUS_CDF = np.array([0.85, 0.93, 0.98])
# the canned views the web UI's dashboard reads (consumers/analytics/ui/app.js)
DASHBOARD_VIEWS = (
    "reward_by_policy", "rollouts_by_status", "stages", "tokens_per_rollout", "staleness",
    "train_steps",
)  # fmt: skip


def llm_events(n: int, tokens: int, rng: np.random.Generator) -> list[Event]:
    out = []
    for i in range(n):
        body = LlmCall(
            call_id=f"c{i}",
            parent_call_id=f"c{i - 1}" if i else None,
            prefix_len=i * tokens,
            prompt_delta=rng.integers(0, 150_000, tokens, dtype=np.uint32),
            completion_ids=rng.integers(0, 150_000, tokens, dtype=np.uint32),
            completion_logprobs=-rng.exponential(0.5, tokens).astype(np.float32),
            model="m",
            backend=f"b{i % 4}",
            policy_version=i // 100,
            latency_ms=float(rng.exponential(800)),
            usage=Usage(tokens * 2, tokens, 0),
        )
        out.append(Event(f"e{i:012d}", f"r{i // 50}", i % 50, T0 + i * 1000, body, "bench"))
    return out


def small_events(n: int) -> list[Event]:
    out: list[Event] = []
    for i in range(n):
        rid, seq, ts = f"r{i // 10}", i % 10, T0 + i * 1000
        k = i % 10
        body: Any
        if k == 0:
            body = RolloutStarted(f"task{i % 97}", f"g{i // 80}", policy_version=i // 10_000)
        elif k == 9:
            body = RolloutFinished("completed")
        elif k == 8:
            body = Reward(float(i % 2), name="pass", evaluator="unit")
        elif k == 7:
            body = Branch(f"b{i}", "retry", f"c{i}")
        else:
            tool = TOOLS[k % 5]
            body = ToolCall(f"t{i}", tool, '{"cmd":"ls -la"}', "ok\n" * 8, is_error=i % 7 == 0,
                            duration_ms=float(k * 10))  # fmt: skip
        out.append(Event(f"e{i:012d}", rid, seq, ts, body, "bench"))
    return out


def report_dataset(n_events: int, rng: np.random.Generator) -> Iterator[tuple[str, Any, int]]:
    """(topic, record, kafka timestamp) for ~n_events rollout events (rollouts of 2-6 turns of
    LlmCall + ToolCall, the rollout service's six stage events in one of four jobs, a final
    reward, a finish), one sample per rollout and a policy version every 64 rollouts with a
    trainer step's metrics. Deterministic for a seed; token arrays are slices of one pool."""
    pool = rng.integers(0, 32_000, 1 << 20, dtype=np.uint32)
    logprobs = -rng.exponential(0.5, 1 << 20).astype(np.float32)
    produced, r, version = 0, 0, 0
    yield "policy.versions", PolicyVersion(0, "ckpt/0", 0, T0), T0
    while produced < n_events:
        rid, task_no = f"r{r:09d}", r // 8 % 500
        task, group = f"task{task_no:04d}", f"g{r // 8}"
        start = T0 + r * 10_000_000  # a rollout starts every 10 s
        turns = int(rng.integers(2, 7))
        u = rng.random(turns * 2 + 2)  # tool picks, tool errors, reward, status
        lat = rng.gamma(2.0, 300.0, turns)
        dur = rng.gamma(2.0, 50.0, turns)
        off = rng.integers(0, (1 << 20) - 96, turns)
        job = f"job{r % 4}"
        stage_ms = rng.gamma(2.0, (40.0, 400.0, 150.0))  # init, run, eval
        events: list[Any] = [RolloutStarted(task, group, policy_version=version)]
        events.append(StageEvent(StageName.INIT, StagePhase.STARTED, job_id=job, worker="w0"))
        events.append(StageEvent(StageName.INIT, StagePhase.FINISHED, "ok",
                                 float(stage_ms[0]), job, "w0"))  # fmt: skip
        events.append(StageEvent(StageName.RUN, StagePhase.STARTED, job_id=job, worker="w1"))
        for t in range(turns):
            o = int(off[t])
            events.append(
                LlmCall(f"{rid}c{t}", f"{rid}c{t - 1}" if t else None, t * 96,
                        pool[o : o + 64], pool[o + 64 : o + 96], logprobs[o : o + 32],
                        model="m", backend=f"b{r % 3}", policy_version=version,
                        latency_ms=float(lat[t]))
            )  # fmt: skip
            tool = TOOLS[int(u[t] * 5)]
            events.append(ToolCall(f"{rid}t{t}", tool, "{}", "out",
                                   is_error=bool(u[turns + t] < TOOL_ERROR[tool]),
                                   duration_ms=float(dur[t])))  # fmt: skip
        run_status = "ok" if u[-1] < STATUS_CDF[0] else ("failed", "timeout")[r % 2]
        events.append(StageEvent(StageName.RUN, StagePhase.FINISHED, run_status,
                                 float(stage_ms[1]), job, "w1"))  # fmt: skip
        events.append(StageEvent(StageName.EVAL, StagePhase.STARTED, job_id=job, worker="w2"))
        events.append(StageEvent(StageName.EVAL, StagePhase.FINISHED, "ok",
                                 float(stage_ms[2]), job, "w2"))  # fmt: skip
        events.append(Reward(float(u[-2] < (task_no * 37 % 100) / 100), name="tests"))
        status = int(np.searchsorted(STATUS_CDF, u[-1]))
        events.append(RolloutFinished(STATUSES[status]))
        for seq, body in enumerate(events):
            ts = start + seq * 500_000
            yield "rollout.events", Event(f"{rid}e{seq:03d}", rid, seq, ts, body, "bench"), ts
        produced += len(events)
        ts = start + len(events) * 500_000 + 2_000_000
        o = int(off[0])
        yield "samples", Sample(
            f"{rid}s", rid, group, task, pool[o : o + 96], np.ones(96, np.uint8),
            logprobs[o : o + 96], 0.5, 1.0, version, policy_versions=[version],
        ), ts  # fmt: skip
        r += 1
        if r % 64 == 0:
            version += 1
            metrics = {"loss": float(rng.normal(0.1, 0.05)),
                       "clip_frac": float(rng.random() * 0.2),
                       "approx_kl": float(rng.exponential(0.01)),
                       "grad_norm": float(rng.gamma(2, 1)),
                       "step_time_s": float(rng.gamma(4, 2)), "batch_samples": 64.0,
                       "batch_tokens": 6144.0, "stale_dropped": 0.0, "dlq": 0.0}  # fmt: skip
            yield "policy.versions", PolicyVersion(version, f"ckpt/{version}", version, ts,
                                                   64 * version, metrics), ts  # fmt: skip


def timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cpu_timed(fn: Any) -> tuple[float, float]:
    """(wall, process CPU) seconds; CPU includes chDB's threads and is steadier than wall
    time on a machine shared with other work."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def ours_insert(client: Any, db: str, events: list[Event], batch: int) -> None:
    for start in range(0, len(events), batch):
        b = RowBatch("rollout.events", 0)
        for i, ev in enumerate(events[start : start + batch], start):
            b.add(ev, i)
        chstore.insert_batch(client, b.tables, b.token, database=db)


def bare_rows(events: list[Event]) -> dict[str, list[tuple[Any, ...]]]:
    """The rows our mapping makes, as a bare clickhouse-connect user would hand them over:
    Python lists for arrays, datetimes for timestamps."""
    b = RowBatch("rollout.events", 0)
    for i, ev in enumerate(events):
        b.add(ev, i)
    out: dict[str, list[tuple[Any, ...]]] = {}
    for table, rows in b.tables.items():
        ts_col = COLUMNS[table].index("ts")
        conv = []
        for row in rows:
            r = [v.tolist() if isinstance(v, np.ndarray) else v for v in row]
            r[ts_col] = np.datetime64(r[ts_col], "us").astype(object)
            conv.append(tuple(r))
        out[table] = conv
    return out


def bare_insert(client: Any, db: str, events: list[Event], batch: int) -> float:
    total = 0.0
    for start in range(0, len(events), batch):
        tables = bare_rows(events[start : start + batch])  # untimed: the rows are given
        for table, rows in tables.items():
            total += timed(
                lambda t=table, r=rows: client.insert(
                    t, r, column_names=list(COLUMNS[t]), database=db
                )
            )
    return total


def fresh_db(client: Any, name: str) -> str:
    client.command(f"DROP DATABASE IF EXISTS {name} SYNC")
    apply_migrations(client, name)
    return name


def bench_llm(client: Any, n: int, tokens: int, batch: int, repeat: int) -> dict[str, Any]:
    events = llm_events(n, tokens, np.random.default_rng(0))
    ours, bare, cpus = [], [], []
    for rep in range(repeat):
        db = fresh_db(client, f"bench_ours_{rep}")
        wall, cpu = cpu_timed(lambda db=db: ours_insert(client, db, events, batch))
        ours.append(wall)
        cpus.append(cpu)
        db = fresh_db(client, f"bench_bare_{rep}")
        bare.append(bare_insert(client, db, events, batch))
    stored = client.command("SELECT count() FROM bench_ours_0.llm_calls")
    assert int(stored) == n, stored
    o, b = n / min(ours), n / min(bare)
    return {
        "llm_events": n,
        "tokens_per_array": tokens,
        "batch": batch,
        "ours_rows_per_s": round(o, 1),
        "bare_rows_per_s": round(b, 1),
        "ours_vs_bare": round(o / b, 2),
        "ours_tokens_per_s": round(o * tokens * 2),
        "ours_rows_per_cpu_s": round(n / min(cpus), 1),
    }


def bench_small(client: Any, n: int, batch: int, repeat: int) -> dict[str, Any]:
    events = small_events(n)
    rows = sum(len(v) for v in bare_rows(events[:1000]).values()) * n / 1000
    times, cpus, mapping = [], [], []
    for rep in range(repeat):
        db = fresh_db(client, f"bench_small_{rep}")
        wall, cpu = cpu_timed(lambda db=db: ours_insert(client, db, events, batch))
        times.append(wall)
        cpus.append(cpu)

        def map_only() -> None:
            for start in range(0, n, batch):
                b = RowBatch("rollout.events", 0)
                for i, ev in enumerate(events[start : start + batch], start):
                    b.add(ev, i)

        mapping.append(timed(map_only))
    best = min(times)
    return {
        "small_events": n,
        "small_rows": int(rows),
        "small_batch": batch,
        "small_events_per_s": round(n / best),
        "small_rows_per_s": round(rows / best),
        "small_rows_per_cpu_s": round(rows / min(cpus)),
        "small_mapping_events_per_s": round(n / min(mapping)),
    }


def _loaded(client: Any, db: str) -> int:
    try:
        return int(client.command(f"SELECT count() FROM {db}.events"))
    except Exception:  # no such database yet
        return 0


def bench_reports(
    client: Any, n: int, batch: int, repeat: int, *, reuse: bool = False
) -> dict[str, Any]:
    """Load ~n events through the sink's row mapping, then time each canned view. ``reuse``
    (with --path): keep a database an earlier run loaded (data generation for 10M events takes
    10-25 min; it can run at low priority and the timing later, on a quiet box)."""
    db = "bench_reports"
    if reuse and _loaded(client, db) >= n:
        apply_migrations(client, db)  # data loaded before a new migration: it backfills
        return _time_reports(client, db, repeat, load=None)
    db = fresh_db(client, db)
    rng = np.random.default_rng(1)
    batches: dict[str, RowBatch] = {}
    offsets: dict[str, int] = {}
    load = time.perf_counter()
    for topic, record, ts in report_dataset(n, rng):
        b = batches.setdefault(topic, RowBatch(topic, 0))
        offsets[topic] = offsets.get(topic, -1) + 1
        b.add(record, offsets[topic], timestamp_us=ts)
        if len(b) >= batch:
            chstore.insert_batch(client, b.tables, b.token, database=db)
            batches[topic] = RowBatch(topic, 0)
    for b in batches.values():
        if len(b):
            chstore.insert_batch(client, b.tables, b.token, database=db)
    return _time_reports(client, db, repeat, load=time.perf_counter() - load)


def _time_reports(client: Any, db: str, repeat: int, *, load: float | None) -> dict[str, Any]:
    events = int(client.command(f"SELECT count() FROM {db}.events"))
    latency: dict[str, float] = {}
    median: dict[str, float] = {}
    rows: dict[str, int] = {}
    for name in reports.VIEWS:
        times = [
            timed(lambda name=name: rows.__setitem__(
                name, len(reports.run_report(client, name, database=db))))
            for _ in range(repeat)
        ]  # fmt: skip
        latency[name] = round(min(times) * 1000, 1)
        median[name] = round(float(np.median(times)) * 1000, 1)
    ui = _time_ui(client, db, repeat)
    dash = sum(median[v] for v in DASHBOARD_VIEWS if v in median)
    return {
        "report_events": events,
        "dashboard_views_ms_median_sum": round(dash, 1),
        "ui_ms": {k: round(min(t) * 1000, 1) for k, t in ui.items()},
        "ui_ms_median": {k: round(float(np.median(t)) * 1000, 1) for k, t in ui.items()},
        "report_load_s": None if load is None else round(load, 1),
        "report_load_events_per_s": None if load is None else round(events / load),
        "report_ms": latency,
        "report_ms_median": median,
        "report_rows": rows,
    }


def _time_ui(client: Any, db: str, repeat: int) -> dict[str, list[float]]:
    """Seconds per run of each web UI data endpoint (ui_api.py) as the rollout browser, the
    group page and the tree viewer call it, over the report dataset (queries + assembly)."""
    rid = "r000000100"  # report_dataset's rollout 100: group g12, task0012
    calls = {
        "filters": ("filters", []),
        "rollouts": ("rollouts", [("limit", "50")]),
        "rollouts?task": ("rollouts", [("task", "task0012"), ("limit", "50")]),
        "rollouts?min_reward": ("rollouts", [("min_reward", "0.5"), ("limit", "50")]),
        "rollouts?offset": ("rollouts", [("offset", "10000"), ("limit", "50")]),
        "group": ("group", [("group", "g12")]),
        "trajectory": ("trajectory", [("rollout", rid)]),
        "tokens": ("tokens", [("rollout", rid), ("call", f"{rid}c1")]),
        "throughput": ("throughput", []),  # the dashboard's tokens/s and per-minute chart
    }

    def ask(q: ui_api.Query) -> chstore.Table:
        return chstore.query(client, q.sql, q.params)

    out: dict[str, list[float]] = {}
    for key, (name, raw) in calls.items():
        spec = ui_api.ENDPOINTS[name]
        params = ui_api.parse_params(spec, raw)
        out[key] = [timed(lambda s=spec, p=params: s.run(p, db, ask)) for _ in range(repeat)]
    return out


def bench_codecs(client: Any) -> dict[str, Any]:
    import glob
    import sysconfig

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/**/*.py", recursive=True))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train(files[:400], trainers.BpeTrainer(vocab_size=32_000, show_progress=False))
    texts = [Path(f).read_text(errors="replace") for f in files[400:900]]
    ids = np.concatenate([np.array(e.ids, np.uint32) for e in tok.encode_batch(texts)])
    per_row = 2000
    rows = ids.size // per_row
    ids = ids[: rows * per_row]
    rng = np.random.default_rng(0)
    near = rng.random(ids.size) < 0.7
    logprobs = np.where(near, -rng.exponential(2e-4, ids.size), -rng.exponential(1.5, ids.size))
    candidates = {
        "ids": ("UInt32", ids, ["LZ4", "ZSTD(1)", "ZSTD(3)", "T64, ZSTD(1)", "T64, ZSTD(3)",
                                "Delta, ZSTD(1)", "T64, LZ4"]),
        "logprobs": ("Float32", logprobs.astype(np.float32),
                     ["LZ4", "ZSTD(1)", "ZSTD(3)", "FPC, ZSTD(1)", "Gorilla, ZSTD(1)"]),
    }  # fmt: skip
    out: dict[str, Any] = {"codec_tokens": int(ids.size)}
    for what, (typ, data, codecs) in candidates.items():
        split = [data[i * per_row : (i + 1) * per_row] for i in range(rows)]
        for codec in codecs:
            client.command("DROP TABLE IF EXISTS default.codec_probe SYNC")
            client.command(
                f"CREATE TABLE default.codec_probe (id UInt32, a Array({typ}) CODEC({codec})) "
                "ENGINE = MergeTree ORDER BY id SETTINGS min_bytes_for_wide_part = 0"
            )
            arrow = chstore.pa.table(
                {"id": np.arange(rows, dtype=np.uint32),
                 "a": chstore._numeric_list(split, data.dtype)}
            )  # fmt: skip
            client.insert_arrow("default.codec_probe", arrow)
            client.command("OPTIMIZE TABLE default.codec_probe FINAL")
            size = client.command(
                "SELECT sum(column_data_compressed_bytes) FROM system.parts_columns "
                "WHERE database = 'default' AND table = 'codec_probe' AND active AND column = 'a'"
            )
            out[f"codec_{what}_{codec.replace(', ', '+')}_bytes_per_token"] = round(
                int(size) / data.size,
                3,
            )
    client.command("DROP TABLE IF EXISTS default.codec_probe SYNC")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, < 30 s")
    p.add_argument("--path", type=Path, help="chDB data dir (default: a temp dir)")
    p.add_argument("--llm-events", type=int)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--llm-batch", type=int, default=500)
    p.add_argument("--small-events", type=int)
    p.add_argument("--small-batch", type=int, default=20_000)
    p.add_argument("--report-events", type=int, help="events behind the reports (full: 10M)")
    p.add_argument("--report-batch", type=int, default=50_000)
    p.add_argument("--repeat", type=int)
    p.add_argument("--codecs", action="store_true", help="measure token-array codecs")
    p.add_argument(
        "--reports-only",
        action="store_true",
        help="only the reports; with --path, reuse data an earlier run loaded",
    )
    a = p.parse_args()
    quick = a.quick
    llm_n = a.llm_events or (600 if quick else 4000)
    small_n = a.small_events or (40_000 if quick else 300_000)
    report_n = a.report_events or (30_000 if quick else 1_000_000)
    repeat = a.repeat or (2 if quick else 3)

    with tempfile.TemporaryDirectory() as tmp:
        client = chstore.connect(f"chdb://{a.path or tmp}")
        try:
            result: dict[str, Any] = {
                "bench": "chstore",
                "quick": quick,
                "engine": "chdb " + str(client.command("SELECT version()")),
                "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            }
            if not a.reports_only:
                result.update(bench_llm(client, llm_n, a.tokens, a.llm_batch, repeat))
                print(
                    f"llm: {result['ours_rows_per_s']} vs bare {result['bare_rows_per_s']} rows/s"
                )
                result.update(bench_small(client, small_n, a.small_batch, repeat))
                print(f"small: {result['small_rows_per_s']} rows/s")
            result.update(
                bench_reports(
                    client,
                    report_n,
                    a.report_batch,
                    repeat,
                    reuse=a.reports_only and a.path is not None,
                )
            )
            print(f"reports over {result['report_events']} events: {result['report_ms']}")
            print(f"UI endpoints (median ms): {result['ui_ms_median']}")
            if a.codecs:
                result.update(bench_codecs(client))
            result["targets_met"] = {
                "reports_under_1s": max(result["report_ms"].values()) < 1000,
                "ui_endpoints_under_1s": max(result["ui_ms_median"].values()) < 1000,
            }
            if not a.reports_only:
                result["targets_met"].update({
                    "llm_ours_vs_bare_ge_0_8": result["ours_vs_bare"] >= 0.8,
                    "small_rows_per_s_ge_100k": result["small_rows_per_s"] >= 100_000,
                })  # fmt: skip
        finally:
            client.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
