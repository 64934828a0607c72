"""Explicit branch points over HTTP (POST /v1/rollouts/{id}/branches) end to end: the real `openai`
client -> proxy (uvicorn) -> reference model server, a harness that rewinds to an earlier call
and continues from there; the events read back from the real Kafka broker and rebuilt into a
trajectory by the stream core. The call after a rewind hangs under the call it names, where the
longest shared prefix alone would have hung it inside the later sibling (a control rollout
without the branch shows that)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from test_proxy import (
    ADMIN,
    by_rollout,
    calls_of,
    consume,
    create_rollout,
    full_prompts,
    model_dir,
    model_server,
    proxy_settings,
    running_proxy,
)

from rollstream.producers.proxy.openai_wire import MAX_BRANCH_REASON
from rollstream.schemas import Branch, BranchKind, CommonSettings, Event, Trajectory
from rollstream.streams.core.trajectory import replay

pytestmark = pytest.mark.integration
__all__ = ["model_dir", "model_server"]  # module fixtures shared with test_proxy

SYSTEM = {"role": "system", "content": "You are terse."}


def ask(client: openai.OpenAI, messages: Any, seed: int) -> tuple[Any, str]:
    """(the reply as a message to send back, the call id) of one chat call."""
    r = client.chat.completions.create(
        model="m", messages=messages, max_tokens=8, seed=seed, temperature=1.0
    )
    reply = r.choices[0].message.model_dump(exclude_none=True)
    ext: Any = r.model_extra
    return reply, ext["rollstream"]["call_id"]


def converse(url: str, ro: dict[str, Any], *, rewind: bool) -> dict[str, str]:
    """X, then Y continuing X, then (after a posted rewind to X, when ``rewind``) Z continuing
    X with another question. Returns the call ids and the branch id."""
    client = openai.OpenAI(base_url=ro["base_url"], api_key=ro["token"], max_retries=0)
    first = [SYSTEM, {"role": "user", "content": "First question"}]
    reply_x, x = ask(client, first, 1)
    _, y = ask(client, [*first, reply_x, {"role": "user", "content": "Second question"}], 2)
    ids = {"x": x, "y": y}
    if rewind:
        auth = {"Authorization": f"Bearer {ro['token']}"}
        body = {"kind": "rewind", "source_call_id": x, "reason": "the second question led nowhere"}
        r = httpx.post(f"{url}/v1/rollouts/{ro['rollout_id']}/branches", json=body, headers=auth)
        assert r.status_code == 201, r.text
        assert r.json()["source_call_id"] == x and r.json()["kind"] == "rewind"
        ids["branch"] = r.json()["branch_id"]
    _, ids["z"] = ask(client, [*first, reply_x, {"role": "user", "content": "Second, again"}], 3)
    return ids


def trajectory_of(events: list[Event]) -> Trajectory:
    _, outputs = replay(events)
    (trajectory,) = outputs  # one Trajectory, nothing dead-lettered
    assert isinstance(trajectory, Trajectory), trajectory
    return trajectory


def test_the_call_after_a_rewind_hangs_under_the_branch_source(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path, model_server: str
) -> None:
    settings = proxy_settings(kafka_settings, tmp_path, model_dir, [model_server])
    with running_proxy(settings) as (url, recorder, _):
        ro, control = create_rollout(url, task_id="rewind"), create_rollout(url, task_id="plain")
        ids = converse(url, ro, rewind=True)
        plain = converse(url, control, rewind=False)
        for r in (ro, control):
            auth = {"Authorization": f"Bearer {r['token']}"}
            done = httpx.post(f"{url}/v1/rollouts/{r['rollout_id']}/finish", json={}, headers=auth)
            assert done.status_code == 200, done.text
        assert recorder.flush(30)

    rollouts = by_rollout(consume(kafka_settings))
    events = rollouts[ro["rollout_id"]]
    assert [e.kind for e in events] == ["RolloutStarted", "LlmCall", "LlmCall", "Branch",
                                        "LlmCall", "RolloutFinished"]  # fmt: skip
    (branch,) = [e.body for e in events if isinstance(e.body, Branch)]
    assert (branch.branch_id, branch.kind, branch.source_call_id, branch.reason) == (
        ids["branch"], BranchKind.REWIND, ids["x"], "the second question led nowhere"
    )  # fmt: skip
    # on the wire: Z's parent is X, its prefix X's whole sequence (prompt + completion)
    x, y, z = calls_of(events)
    prompts = full_prompts([x, y, z])
    x_len = len(prompts[0]) + len(x.completion_ids)
    assert (y.parent_call_id, y.prefix_len) == (ids["x"], x_len)
    assert (z.parent_call_id, z.prefix_len) == (ids["x"], x_len)
    assert prompts[2][:x_len].tolist() == prompts[1][:x_len].tolist()
    # the stream core's tree: Z beside Y under X, and the branch point in the metadata
    traj = trajectory_of(events)
    parents = {n.call_id: (n.parent_call_id, n.prefix_len) for n in traj.nodes}
    assert parents == {ids["x"]: (None, 0), ids["y"]: (ids["x"], x_len),
                       ids["z"]: (ids["x"], x_len)}  # fmt: skip
    assert traj.metadata[f"rollstream.branch.{ids['branch']}"] == f"rewind:{ids['x']}"

    # the control, without the branch: Z shares X's sequence and the next user header with Y
    # (the longest prefix), so it hangs inside Y
    cx, _, cz = calls = calls_of(rollouts[control["rollout_id"]])
    cx_len = len(full_prompts(calls)[0]) + len(cx.completion_ids)
    assert cz.parent_call_id == plain["y"] and cz.prefix_len > cx_len
    tree = {n.call_id: n for n in trajectory_of(rollouts[control["rollout_id"]]).nodes}
    assert tree[plain["z"]].parent_call_id == plain["y"]


def test_branch_route_answers(
    kafka_settings: CommonSettings, tmp_path: Path, model_dir: Path, model_server: str
) -> None:
    """Every answer of the route: 201, a retried branch_id (200, not recorded twice), the
    admin key, and 400 naming the field, 401, 403, 404, 409."""
    settings = proxy_settings(kafka_settings, tmp_path, model_dir, [model_server])
    with running_proxy(settings) as (url, recorder, _):
        ro, other = create_rollout(url), create_rollout(url)
        client = openai.OpenAI(base_url=ro["base_url"], api_key=ro["token"], max_retries=0)
        _, call_id = ask(client, [{"role": "user", "content": "hi"}], 1)
        oclient = openai.OpenAI(base_url=other["base_url"], api_key=other["token"], max_retries=0)
        _, other_call = ask(oclient, [{"role": "user", "content": "hi"}], 1)
        route = f"{url}/v1/rollouts/{ro['rollout_id']}/branches"
        auth = {"Authorization": f"Bearer {ro['token']}"}
        admin = {"Authorization": f"Bearer {ADMIN}"}

        def post(body: Any, headers: dict[str, str] | None = auth, **kw: Any) -> httpx.Response:
            return httpx.post(kw.pop("to", route), json=body, headers=headers, **kw)

        r = post({})  # every field optional: a fork from nowhere named
        assert r.status_code == 201 and r.json()["kind"] == "fork", r.text
        assert r.json()["source_call_id"] is None
        body = {"kind": "retry", "source_call_id": call_id, "branch_id": "retry-1"}
        assert post(body).status_code == 201
        r = post(body)  # the same branch_id again: a retried request
        assert (r.status_code, r.json()["duplicate"]) == (200, True), r.text
        r = post({"kind": "subagent", "source_call_id": call_id}, admin)
        assert r.status_code == 201, r.text
        bad: list[tuple[Any, str]] = [
            ({"source_call_id": "no-such-call"}, "source_call_id"),
            ({"source_call_id": other_call}, "source_call_id"),  # another rollout's call
            ({"source_call_id": 7}, "source_call_id"),
            ({"kind": "sideways"}, "kind"),
            ({"kind": 3}, "kind"),
            ({"kind": None}, "kind"),
            ({"reason": "x" * (MAX_BRANCH_REASON + 1)}, "reason"),
            ({"reason": ["why"]}, "reason"),
            ({"branch_id": "has space"}, "branch_id"),
            ({"branch_id": "b" * 129}, "branch_id"),
            ({"branch_id": "ok\n"}, "branch_id"),
            ({"branch_id": ""}, "branch_id"),
        ]
        for body, param in bad:
            r = post(body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        r = httpx.post(route, content=b"{nope", headers=auth)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        assert post({}, None).status_code == 401
        assert post({}, {"Authorization": "Bearer rs1.x.y"}).status_code == 401
        assert post({}, {"Authorization": f"Bearer {other['token']}"}).status_code == 403
        r = post({}, admin, to=f"{url}/v1/rollouts/no-such-rollout/branches")
        assert r.status_code == 404 and r.json()["error"]["code"] == "rollout_not_found"
        httpx.post(f"{url}/v1/rollouts/{ro['rollout_id']}/finish", json={}, headers=auth)
        r = post({"kind": "fork"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "rollout_finished"
        doc = httpx.get(f"{url}/openapi.json").json()["paths"]
        op = doc["/v1/rollouts/{rollout_id}/branches"]["post"]
        props = op["requestBody"]["content"]["application/json"]["schema"]["properties"]
        assert props["reason"]["maxLength"] == MAX_BRANCH_REASON
        assert set(props["kind"]["enum"]) == {k.value for k in BranchKind}
        assert {"400", "404", "409", "429"} <= set(op["responses"])
        assert recorder.flush(30)

    events = by_rollout(consume(kafka_settings))[ro["rollout_id"]]
    branches = [e.body for e in events if isinstance(e.body, Branch)]
    assert [(b.kind, b.source_call_id) for b in branches] == [
        (BranchKind.FORK, None), (BranchKind.RETRY, call_id), (BranchKind.SUBAGENT, call_id)
    ]  # fmt: skip
    assert branches[1].branch_id == "retry-1"
    trajectory_of(events)  # the builder takes every one of them: nothing dead-lettered
