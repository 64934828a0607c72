"""The web UI's data endpoints without a store: parameter bounds, the SQL they build, how tree
nodes hang on their parents, and the token view of a path (masks, rewinds, unknown parents).
The store itself is exercised by tests/integration/test_ui_browser.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rollstream.consumers.analytics import ui_api, ui_tree
from rollstream.consumers.analytics.readonly import check_read_only
from rollstream.consumers.analytics.ui_api import (
    ENDPOINTS,
    ParamError,
    Query,
    RolloutsParams,
    node_links,
    parse_params,
    path_tokens,
    rollouts_query,
)


def test_params_are_bounded_and_errors_name_the_field() -> None:
    spec = ENDPOINTS["rollouts"]
    p = parse_params(spec, [("task", "A"), ("min_reward", "0.5"), ("limit", "10"), ("job", "")])
    assert (p.task, p.min_reward, p.limit, p.job) == ("A", 0.5, 10, "")
    bad = [
        [("limit", "0")], [("limit", "1001")], [("offset", "-1")], [("status", "weird")],
        [("min_reward", "nan")], [("min_reward", "1e300")], [("policy_version", "x")],
        [("task", "t" * 257)], [("unknown", "1")], [("task", "a"), ("task", "b")],
    ]  # fmt: skip
    for raw in bad:
        with pytest.raises(ParamError) as err:
            parse_params(spec, raw)
        assert str(err.value).startswith(raw[0][0]), (raw, str(err.value))
    with pytest.raises(ParamError, match=r"^rollout"):
        parse_params(ENDPOINTS["trajectory"], [])
    with pytest.raises(ParamError, match=r"^limit"):
        parse_params(ENDPOINTS["tokens"], [("rollout", "r"), ("call", "c"), ("limit", "50001")])


def test_rollouts_query_binds_every_filter() -> None:
    q = rollouts_query(
        RolloutsParams(job="j", task="t", group="g", status="failed", min_reward=0.1,
                       max_reward=0.9, policy_version=3, limit=7, offset=14),
        "rollstream_x",
    )  # fmt: skip
    for cond in ("r.task_id = {task:String}", "r.group_id = {grp:String}", "j.job = {job:String}",
                 "r.status = {status:String}", "r.policy_version = {pv:Int64}",
                 "f.reward >= {rmin:Float64}", "f.reward <= {rmax:Float64}"):  # fmt: skip
        assert cond in q.sql
    assert q.params == {"task": "t", "grp": "g", "status": "failed", "job": "j", "pv": 3,
                        "rmin": 0.1, "rmax": 0.9, "lim": 7, "off": 14}  # fmt: skip
    plain = rollouts_query(RolloutsParams(), "rollstream_x")
    assert "\nWHERE" not in plain.sql and plain.params == {"lim": 100, "off": 0}
    # what a user typed never reaches the SQL text
    evil = rollouts_query(RolloutsParams(task="x' OR 1=1 --"), "rollstream_x")
    assert "OR 1=1" not in evil.sql and evil.params["task"] == "x' OR 1=1 --"
    # the server's own read-only lexer accepts every query the endpoints build
    check_read_only(evil.sql, database="rollstream_x")
    for q in ui_tree.trajectory_queries(
        ui_api.TrajectoryParams(rollout="r"), "rollstream_x"
    ).values():
        check_read_only(q.sql, database="rollstream_x")
    shape, arrays = ui_tree.tokens_queries(
        ui_api.TokensParams(rollout="r", call="c"), "rollstream_x"
    )
    check_read_only(shape.sql, database="rollstream_x")
    check_read_only(arrays(["a", "b"]).sql, database="rollstream_x")


def test_node_links() -> None:
    # c1 root; c2 and c3 at the same place under c1 (branch); c4 re-parented to c1 and
    # starting inside c1's 5 tokens (rewind); c5 a new root naming c2 (subagent); c6 appends
    ids = ["c1", "c2", "c3", "c4", "c5", "c6"]
    parents = ["", "c1", "c1", "c1", "", "c5"]
    prefix = [0, 5, 5, 4, 0, 3]
    seg = [5, 3, 3, 3, 3, 2]
    raw = {"c2": "c1", "c3": "c1", "c4": "c2", "c5": "c2", "c6": "c5"}
    assert node_links(ids, parents, prefix, seg, raw) == [
        "root", "branch", "branch", "rewind", "subagent", "append",
    ]  # fmt: skip


class _C:
    def __init__(self, cid: str, parent: str, prefix: int, prompt: list[int],
                 completion: list[int], drift: int = 0) -> None:  # fmt: skip
        self.call_id, self.parent, self.prefix_len = cid, parent, prefix
        self.prompt = np.array(prompt, np.uint32)
        self.completion = np.array(completion, np.uint32)
        self.logprobs = np.array([-0.5] * len(completion), np.float32)
        self.policy_version, self.drift_tokens = 0, drift


def _calls(*calls: _C) -> dict[str, Any]:
    return {c.call_id: c for c in calls}


CALLS = _calls(
    _C("c1", "", 0, [1, 2, 3], [10, 11]),
    _C("c2", "c1", 5, [4], [12, 13]),
    _C("c4", "c2", 4, [7], [15, 16], drift=2),
    _C("c5", "c2", 0, [20, 21], [22]),
    _C("orphan", "gone", 2, [8], [9]),
)


def _tokens(calls: dict[str, Any], leaf: str, offset: int = 0, limit: int = 100) -> dict[str, Any]:
    return ui_tree.token_page(path_tokens(calls, leaf), offset, limit)


def test_path_tokens_follow_appends_and_rewinds_with_masks() -> None:
    seq = path_tokens(CALLS, "c2")
    assert seq["path"] == ["c1", "c2"] and seq["length"] == 8
    page = _tokens(CALLS, "c2")
    assert page["ids"] == [1, 2, 3, 10, 11, 4, 12, 13]
    assert page["mask"] == [0, 0, 0, 1, 1, 0, 1, 1]  # completion tokens are trained
    assert page["logprobs"] == [None, None, None, -0.5, -0.5, None, -0.5, -0.5]
    rewind = _tokens(CALLS, "c4")  # c2's sequence cut at 4, then c4's own tokens
    assert rewind["ids"] == [1, 2, 3, 10, 7, 15, 16]
    assert rewind["mask"] == [0, 0, 0, 1, 0, 1, 1]
    kinds = [(s["call_id"], s["kind"], s["start"], s["end"]) for s in rewind["segments"]]
    assert kinds == [("c1", "prompt", 0, 3), ("c1", "completion", 3, 4),
                     ("c4", "prompt", 4, 5), ("c4", "completion", 5, 7)]  # fmt: skip
    sub = _tokens(CALLS, "c5")  # a subagent starts its own context
    assert sub["ids"] == [20, 21, 22] and sub["mask"] == [0, 0, 1]
    orphan = _tokens(CALLS, "orphan")  # a parent never recorded: its tokens are unknown
    assert orphan["ids"] == [-1, -1, 8, 9] and orphan["mask"] == [0, 0, 0, 1]
    paged = _tokens(CALLS, "c2", offset=4, limit=3)
    assert paged["ids"] == [11, 4, 12] and paged["segment"] == [1, 2, 3]


def test_endpoints_run_over_an_ask_edge() -> None:
    """run_tokens and run_group against a fake query edge: the queries they send and the
    JSON they make of the answers."""
    seen: list[Query] = []

    class Answer:
        def __init__(self, columns: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
            self.columns, self.rows = columns, rows

    def ask(q: Query) -> Answer:
        seen.append(q)
        if "call_id IN" in q.sql:
            wanted = q.params["ids"]
            return Answer(("call_id",), [
                (c.call_id, c.parent, c.prefix_len, c.prompt, c.completion, c.logprobs, 0,
                 c.drift_tokens) for c in CALLS.values() if c.call_id in wanted
            ])  # fmt: skip
        return Answer(("call_id", "parent_call_id", "prefix_len"),
                      [(c.call_id, c.parent, c.prefix_len) for c in CALLS.values()])  # fmt: skip

    p = parse_params(ENDPOINTS["tokens"], [("rollout", "r"), ("call", "c4")])
    out = ENDPOINTS["tokens"].run(p, "rollstream_x", ask)
    assert out["path"] == ["c1", "c2", "c4"] and out["trained_tokens"] == 3
    assert out["drift_calls"] == ["c4"] and out["length"] == 7
    assert sorted(seen[1].params["ids"]) == ["c1", "c2", "c4"]  # only the path's arrays
    with pytest.raises(ParamError, match=r"^call"):
        ENDPOINTS["tokens"].run(parse_params(ENDPOINTS["tokens"], [("rollout", "r"),
                                                                   ("call", "nope")]),
                                "rollstream_x", ask)  # fmt: skip

    def group_ask(q: Query) -> Answer:
        seen.append(q)
        if "FROM rollstream_x.rewards" in q.sql:  # the page's rewards, after the page
            assert sorted(q.params["ids"]) == ["a", "b", "c"]
            return Answer(("rollout_id", "reward"), [("a", 1.0)])
        if "FROM rollstream_x.stages" in q.sql:
            return Answer(("rollout_id", "job"), [("b", "j2")])
        if "FROM rollstream_x.samples" in q.sql:
            cols = ("sample_id", "rollout_id", "advantage", "reward")
            return Answer(cols, [("s1", "a", 0.5, 1.0), ("s2", "a", 0.5, 1.0),
                                 ("s3", "b", -0.5, 0.0)])  # fmt: skip
        assert "JOIN" not in q.sql  # no filter reads rewards or jobs: the page needs no join
        page_cols = ("rollout_id", "status", "reward", "job_id", "total")
        return Answer(page_cols, [("b", "completed", 0.0, "", 3), ("a", "completed", 0.0, "", 3),
                                  ("c", "running", 0.0, "", 3)])  # fmt: skip

    g = ENDPOINTS["group"].run(parse_params(ENDPOINTS["group"], [("group", "g")]),
                               "rollstream_x", group_ask)  # fmt: skip
    assert [r["rollout_id"] for r in g["rollouts"]] == ["a", "b", "c"]
    assert [r["advantage"] for r in g["rollouts"]] == [0.5, -0.5, None]
    assert [len(r["samples"]) for r in g["rollouts"]] == [2, 1, 0]
    assert g["total"] == 3 and g["mean_reward"] == 0.5  # the running rollout is not counted
    assert [r["reward"] for r in g["rollouts"]] == [1.0, 0.0, 0.0]  # no final reward: 0
    assert [r["job_id"] for r in g["rollouts"]] == ["", "j2", ""]


def test_throughput_over_an_ask_edge_and_its_bounds() -> None:
    class Answer:
        def __init__(self, columns: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
            self.columns, self.rows = columns, rows

    seen: list[Query] = []

    def ask(q: Query) -> Answer:
        seen.append(q)
        check_read_only(q.sql, database="rollstream_x")  # what the server would accept
        if "GROUP BY minute" in q.sql:
            return Answer(("minute", "calls", "completion_tokens", "prompt_tokens",
                           "p50_latency_ms"), [("m1", 2, 60, 10, float("nan"))])  # fmt: skip
        return Answer(("calls", "completion_tokens", "last"), [(2, 600, "t")])

    spec = ENDPOINTS["throughput"]
    out = spec.run(parse_params(spec, [("minutes", "30")]), "rollstream_x", ask)
    assert out["minutes"] == [{"minute": "m1", "calls": 2, "completion_tokens": 60,
                               "prompt_tokens": 10, "p50_latency_ms": None}]  # fmt: skip
    assert (out["tokens_per_s"], out["recent_calls"], out["last_call"]) == (2.0, 2, "t")
    assert seen[0].params == {"window": 1800} and seen[1].params == {"window": 300}
    assert "GROUP BY event_id" in seen[0].sql  # each call once, duplicates or not
    empty = spec.run(parse_params(spec, []), "rollstream_x", lambda q: Answer(("c",), []))
    assert (empty["tokens_per_s"], empty["last_call"], empty["minutes"]) == (None, None, [])
    for bad in ("0", "1441", "x"):
        with pytest.raises(ParamError, match=r"^minutes"):
            parse_params(spec, [("minutes", bad)])


def test_lag_rows_per_group_and_topic() -> None:
    from rollstream.adapters.topics import GroupLag, lag_rows

    committed = {
        "ns.sink": {("ns.events", 0): 2, ("ns.events", 1): 10, ("ns.samples", 0): 0},
        "ns.trainer": {("ns.samples", 0): 7, ("ns.gone", 0): 3},  # no high watermark: left out
    }
    highs = {("ns.events", 0): 5, ("ns.events", 1): 9, ("ns.samples", 0): 7}
    assert lag_rows(committed, highs) == [
        GroupLag("ns.sink", "ns.events", 2, 3),  # 5 - 2, and 9 - 10 counts as 0
        GroupLag("ns.sink", "ns.samples", 1, 7),
        GroupLag("ns.trainer", "ns.samples", 1, 0),
    ]
