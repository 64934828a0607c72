"""The web UI's tree viewer endpoints (``GET /ui/api/trajectory``, ``GET /ui/api/tokens``):
bounded parameters, the SQL each runs and the JSON it answers; ui_api.py registers them. Pure:
no ClickHouse client, no HTTP framework.

- ``trajectory``: one rollout's call tree (the trajectories row's nodes, else the raw LLM calls
  while it runs), how each node hangs on its parent (append, branch, rewind, subagent), the
  rewards at the calls they were given at, tool calls, Branch events and samples;
- ``tokens``: the token view of the path from a root to a chosen call: each token's id, its
  loss mask (1 on completion tokens, which are trained; 0 on prompt tokens), its behaviour
  logprob, the call that produced it, and the calls with retokenization drift.

Errors: ``ParamError`` (ui_query.py) for an unknown rollout or call.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from pydantic import Field

from rollstream.consumers.analytics.ui_query import (
    MAX_CALLS,
    MAX_ID,
    MAX_TOOL_TEXT,
    MAX_TOOLS,
    ROLLOUT_COLUMNS,
    Ask,
    ParamError,
    Params,
    Query,
    dicts,
    num,
    samples_query,
)

__all__ = [
    "TokensParams",
    "TrajectoryParams",
    "node_links",
    "path_tokens",
    "run_tokens",
    "run_trajectory",
    "token_page",
    "tokens_queries",
    "trajectory_queries",
]


class TrajectoryParams(Params):
    rollout: str = Field(min_length=1, max_length=MAX_ID)


class TokensParams(Params):
    rollout: str = Field(min_length=1, max_length=MAX_ID)
    call: str = Field(min_length=1, max_length=MAX_ID)
    offset: int = Field(default=0, ge=0, le=100_000_000)
    limit: int = Field(default=4_000, ge=1, le=50_000)


# --- trajectory -------------------------------------------------------------------------------


def trajectory_queries(p: TrajectoryParams, db: str) -> dict[str, Query]:
    key = {"rid": p.rollout}
    where = "WHERE rollout_id = {rid:String}"
    return {
        "summary": _summary_query(p.rollout, db),
        "trajectory": Query(
            "SELECT status, score, score_source, error, num_events, node_call_ids, "
            "node_parent_ids, node_prefix_lens, node_prompt_lens, node_completion_lens, "
            "node_policy_versions, "
            "node_finish_reasons, reward_values, reward_kinds, reward_names, reward_at_call_ids "
            f"FROM {db}.trajectories FINAL {where} LIMIT 1", key),
        "calls": Query(
            "SELECT call_id, parent_call_id, seq, prefix_len, length(prompt_delta) AS prompt_len, "
            "length(completion_ids) AS completion_len, model, backend, policy_version, "
            f"latency_ms, drift_tokens, finish_reason FROM {db}.llm_calls FINAL {where} "
            f"ORDER BY seq LIMIT {MAX_CALLS}", key),
        "tools": Query(
            f"SELECT seq, tool_call_id, name, "
            f"substring(arguments, 1, {MAX_TOOL_TEXT}) AS arguments, "
            f"substring(result, 1, {MAX_TOOL_TEXT}) AS result, "
            f"result_truncated OR length(result) > {MAX_TOOL_TEXT} AS truncated, is_error, "
            f"duration_ms, at_call_id FROM {db}.tool_calls FINAL {where} "
            f"ORDER BY seq LIMIT {MAX_TOOLS}", key),
        "rewards": Query(
            f"SELECT seq, value, kind, name, at_call_id FROM {db}.rewards FINAL {where} "
            f"ORDER BY seq LIMIT {MAX_TOOLS}", key),
        "branches": Query(
            f"SELECT seq, body_json FROM {db}.events FINAL {where} AND type = 'Branch' "
            f"ORDER BY seq LIMIT {MAX_TOOLS}", key),
        "samples": samples_query(db, rollout=p.rollout),
    }  # fmt: skip


def _summary_query(rollout: str, db: str) -> Query:
    return Query(
        f"""WITH finals AS (
    SELECT rollout_id, sum(value) AS reward FROM {db}.rewards FINAL
    WHERE kind = 'final' AND rollout_id = {{rid:String}} GROUP BY rollout_id
),
jobs AS (
    SELECT rollout_id, any(job_id) AS job FROM {db}.stages
    WHERE job_id != '' AND rollout_id = {{rid:String}} GROUP BY rollout_id
)
SELECT {ROLLOUT_COLUMNS}
FROM {db}.rollout_status AS r
LEFT JOIN finals AS f ON f.rollout_id = r.rollout_id
LEFT JOIN jobs AS j ON j.rollout_id = r.rollout_id
WHERE r.rollout_id = {{rid:String}}""",
        {"rid": rollout},
    )


def node_links(
    ids: Sequence[str],
    parents: Sequence[str],
    prefix_lens: Sequence[int],
    seg_lens: Sequence[int],
    raw_parents: Mapping[str, str],
) -> list[str]:
    """How each node hangs on its tree parent: ``root``; ``subagent`` (a new root whose call
    names a parent: its own chain); ``rewind`` (it starts before the end of its parent's
    sequence, or the tree re-parented it to an ancestor of the call it named); ``branch`` (one
    of several children at the same place); ``append`` (the conversation went on)."""
    index = {c: i for i, c in enumerate(ids)}
    children_at: dict[tuple[str, int], int] = {}
    for parent, q in zip(parents, prefix_lens, strict=True):
        if parent:
            children_at[(parent, q)] = children_at.get((parent, q), 0) + 1
    out: list[str] = []
    for call, parent, q in zip(ids, parents, prefix_lens, strict=True):
        raw = raw_parents.get(call, "")
        if not parent:
            out.append("subagent" if raw else "root")
            continue
        j = index.get(parent)
        end = prefix_lens[j] + seg_lens[j] if j is not None else q
        if q < end or (raw and raw != parent):
            out.append("rewind")
        elif children_at[(parent, q)] > 1:
            out.append("branch")
        else:
            out.append("append")
    return out


def _tree_nodes(traj: dict[str, Any] | None, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tree's nodes: the trajectory's (normalized, deduplicated) when it exists, else the
    raw calls (a running rollout), each joined to its call's LLM metadata."""
    by_call = {c["call_id"]: c for c in calls}
    if traj is not None:
        ids = list(traj["node_call_ids"])
        parents = list(traj["node_parent_ids"])
        prefix = [int(x) for x in traj["node_prefix_lens"]]
        prompt = [int(x) for x in traj["node_prompt_lens"]]
        completion = [int(x) for x in traj["node_completion_lens"]]
        versions = [int(x) for x in traj["node_policy_versions"]]
        finish = list(traj["node_finish_reasons"])
    else:
        known = set(by_call)
        ids = [c["call_id"] for c in calls]
        parents = [c["parent_call_id"] if c["parent_call_id"] in known and c["prefix_len"] else ""
                   for c in calls]  # fmt: skip
        prefix = [int(c["prefix_len"]) for c in calls]
        prompt = [int(c["prompt_len"]) for c in calls]
        completion = [int(c["completion_len"]) for c in calls]
        versions = [int(c["policy_version"]) for c in calls]
        finish = [c["finish_reason"] for c in calls]
    seg = [a + b for a, b in zip(prompt, completion, strict=True)]
    raw = {c["call_id"]: c["parent_call_id"] for c in calls}
    links = node_links(ids, parents, prefix, seg, raw)
    nodes = []
    for i, call in enumerate(ids):
        meta = by_call.get(call, {})
        nodes.append({
            "call_id": call, "parent": parents[i], "raw_parent": raw.get(call, ""),
            "link": links[i], "prefix_len": prefix[i], "prompt_len": prompt[i],
            "completion_len": completion[i], "policy_version": versions[i],
            "finish_reason": finish[i], "seq": meta.get("seq"),
            "model": meta.get("model", ""), "backend": meta.get("backend", ""),
            "latency_ms": num(meta.get("latency_ms")), "drift_tokens": meta.get("drift_tokens", 0),
            "rewards": [], "tools": [], "branches": [],
        })  # fmt: skip
    return nodes


def _anchor(seq: int, call_seqs: list[tuple[int, str]]) -> str:
    """The last call recorded before ``seq`` ('' when none): where an unanchored event sits."""
    best = ""
    for s, call in call_seqs:
        if s < seq:
            best = call
        else:
            break
    return best


def run_trajectory(p: TrajectoryParams, db: str, ask: Ask) -> dict[str, Any]:
    q = trajectory_queries(p, db)
    summary = dicts(ask(q["summary"]))
    if not summary:
        raise ParamError(f"rollout: no rollout {p.rollout!r} in this namespace")
    trajs = dicts(ask(q["trajectory"]))
    traj = trajs[0] if trajs else None
    calls = dicts(ask(q["calls"]))
    nodes = _tree_nodes(traj, calls)
    by_id = {n["call_id"]: n for n in nodes}
    call_seqs = sorted((int(c["seq"]), c["call_id"]) for c in calls)
    unplaced: list[dict[str, Any]] = []

    def place(item: dict[str, Any], key: str, at: str) -> None:
        node = by_id.get(at)
        (node[key] if node is not None else unplaced).append(item)

    if traj is not None:
        rewards = [
            {"value": num(v), "kind": k, "name": n, "at_call_id": a}
            for v, k, n, a in zip(traj["reward_values"], traj["reward_kinds"],
                                  traj["reward_names"], traj["reward_at_call_ids"], strict=True)
        ]  # fmt: skip
    else:
        rewards = [
            {"value": num(r["value"]), "kind": r["kind"], "name": r["name"],
             "at_call_id": r["at_call_id"]}
            for r in dicts(ask(q["rewards"]))
        ]  # fmt: skip
    for r in rewards:
        place({**r, "kind_of": "reward"}, "rewards", r["at_call_id"])
    for t in dicts(ask(q["tools"])):
        at = t["at_call_id"] or _anchor(int(t["seq"]), call_seqs)
        item = {**t, "duration_ms": num(t["duration_ms"]), "anchored": bool(t["at_call_id"])}
        place(item, "tools", at)
    for b in dicts(ask(q["branches"])):
        try:
            body = json.loads(b["body_json"])
        except ValueError:
            continue
        body = body if isinstance(body, dict) else {}
        item = {"seq": b["seq"], "branch_id": body.get("branch_id", ""),
                "kind": body.get("kind", ""), "reason": body.get("reason", ""),
                "source_call_id": body.get("source_call_id") or ""}  # fmt: skip
        place(item, "branches", item["source_call_id"])
    samples = [{k: num(v) for k, v in s.items()} for s in dicts(ask(q["samples"]))]
    head = {k: num(v) for k, v in summary[0].items()}
    if traj is not None:
        head |= {"score_source": traj["score_source"], "error": traj["error"],
                 "num_events": traj["num_events"]}  # fmt: skip
    return {
        "rollout": head,
        "rebuilt": traj is not None,
        "nodes": nodes,
        "unplaced": unplaced,
        "samples": samples,
    }


# --- tokens -----------------------------------------------------------------------------------


class _Call(NamedTuple):
    call_id: str
    parent: str
    prefix_len: int
    prompt: Sequence[int]
    completion: Sequence[int]
    logprobs: Sequence[float]
    policy_version: int
    drift_tokens: int


def path_tokens(calls: Mapping[str, _Call], leaf: str) -> dict[str, Any]:
    """The full sequence of call ``leaf`` as its recorded calls built it: each call's sequence
    is its parent's sequence cut at ``prefix_len`` (a rewind cuts it short; no parent: empty)
    plus its prompt delta plus its completion. Returns the path (root first), the segments
    (call, kind prompt | completion, start, end) and per-token arrays: ids, mask (1 on
    completion tokens: trained; 0 on prompt tokens), behaviour logprobs (None on prompt
    tokens) and the segment of each token. A parent that was never recorded leaves its
    ``prefix_len`` tokens unknown (id -1)."""
    path: list[str] = []
    seen: set[str] = set()
    call_id = leaf
    while call_id and call_id in calls and call_id not in seen:
        seen.add(call_id)
        path.append(call_id)
        c = calls[call_id]
        call_id = c.parent if c.prefix_len else ""
    path.reverse()
    segments: list[dict[str, Any]] = []  # each: call, kind, start, end, (source arrays, offset)
    length = 0
    first = calls[path[0]]
    if first.prefix_len:  # the root names a parent that was never recorded
        segments.append({"call_id": first.parent, "kind": "unknown", "start": 0,
                         "end": first.prefix_len, "src": None, "src_start": 0})  # fmt: skip
        length = first.prefix_len
    for call_id in path:
        c = calls[call_id]
        if call_id != path[0]:
            cut = min(c.prefix_len, length)
            while segments and segments[-1]["start"] >= cut:
                segments.pop()
            if segments and segments[-1]["end"] > cut:
                segments[-1] = {**segments[-1], "end": cut}
            length = cut
        for kind, arr in (("prompt", c.prompt), ("completion", c.completion)):
            if len(arr):
                segments.append(
                    {
                        "call_id": call_id,
                        "kind": kind,
                        "start": length,
                        "end": length + len(arr),
                        "src": (c, kind),
                        "src_start": 0,
                    }
                )
                length += len(arr)
    return {"path": path, "segments": segments, "length": length}


def token_page(seq: dict[str, Any], offset: int, limit: int) -> dict[str, Any]:
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float | None] = []
    segment: list[int] = []
    end = min(seq["length"], offset + limit)
    out_segments = []
    for i, s in enumerate(seq["segments"]):
        out_segments.append({k: s[k] for k in ("call_id", "kind", "start", "end")})
        lo, hi = max(s["start"], offset), min(s["end"], end)
        if lo >= hi:
            continue
        a, b = lo - s["start"], hi - s["start"]
        n = b - a
        if s["src"] is None:
            ids += [-1] * n
            mask += [0] * n
            logprobs += [None] * n
        else:
            call, kind = s["src"]
            if kind == "prompt":
                ids += [int(x) for x in call.prompt[a:b]]
                mask += [0] * n
                logprobs += [None] * n
            else:
                ids += [int(x) for x in call.completion[a:b]]
                mask += [1] * n
                lps = call.logprobs[a:b]
                logprobs += [num(float(x)) for x in lps] + [None] * (n - len(lps))
        segment += [i] * n
    return {"ids": ids, "mask": mask, "logprobs": logprobs, "segment": segment,
            "segments": out_segments}  # fmt: skip


def tokens_queries(p: TokensParams, db: str) -> tuple[Query, Callable[[list[str]], Query]]:
    shape = Query(
        f"SELECT call_id, parent_call_id, prefix_len FROM {db}.llm_calls FINAL "
        f"WHERE rollout_id = {{rid:String}} ORDER BY seq LIMIT {MAX_CALLS}",
        {"rid": p.rollout},
    )

    def arrays(path: list[str]) -> Query:
        return Query(
            "SELECT call_id, parent_call_id, prefix_len, prompt_delta, completion_ids, "
            f"completion_logprobs, policy_version, drift_tokens FROM {db}.llm_calls FINAL "
            "WHERE rollout_id = {rid:String} AND call_id IN {ids:Array(String)} "
            f"ORDER BY seq LIMIT {MAX_CALLS}",
            {"rid": p.rollout, "ids": path},
        )

    return shape, arrays


def run_tokens(p: TokensParams, db: str, ask: Ask) -> dict[str, Any]:
    shape_q, arrays_q = tokens_queries(p, db)
    shape = {r[0]: (r[1], int(r[2])) for r in ask(shape_q).rows}
    if p.call not in shape:
        raise ParamError(f"call: no LLM call {p.call!r} in rollout {p.rollout!r}")
    path: list[str] = []
    call_id = p.call
    while call_id in shape and call_id not in path:  # the ancestors, by the calls' own parents
        path.append(call_id)
        parent, prefix_len = shape[call_id]
        call_id = parent if prefix_len else ""
    calls = {
        r[0]: _Call(r[0], r[1], int(r[2]), r[3], r[4], r[5], int(r[6]), int(r[7]))
        for r in ask(arrays_q(path)).rows
    }
    seq = path_tokens(calls, p.call)
    page = token_page(seq, p.offset, p.limit)
    meta = {c: {"policy_version": calls[c].policy_version, "drift_tokens": calls[c].drift_tokens}
            for c in seq["path"]}  # fmt: skip
    trained = sum(s["end"] - s["start"] for s in seq["segments"] if s["kind"] == "completion")
    return {
        "rollout_id": p.rollout, "call_id": p.call, "path": seq["path"], "calls": meta,
        "length": seq["length"], "trained_tokens": trained, "offset": p.offset,
        "drift_calls": [c for c in seq["path"] if calls[c].drift_tokens > 0], **page,
    }  # fmt: skip
