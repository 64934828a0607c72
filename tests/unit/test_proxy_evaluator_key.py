"""The proxy's evaluator key: it may score, finish, read and post lifecycle events of open
rollouts (the rollout service's EVAL stage), and nothing else; ``<home>/keys.json`` gives the
proxy's admin routes the admin key only and this role the evaluator key."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest
from test_proxy_fastpath import Backend, chat, make_app
from test_proxy_ratelimit import USER, asgi, new_rollout, sdk_asgi

from rollstream.infra.keys import create_keys, read_keys
from rollstream.producers.proxy.chat import ChatTemplate
from rollstream.producers.proxy.settings import ProxySettings

__all__ = ["chat"]  # the module fixture shared with test_proxy_fastpath

EVALUATOR = "unit-evaluator"


def test_the_evaluator_key_scores_and_finishes_and_does_nothing_else(chat: ChatTemplate) -> None:
    app, recorder = make_app(chat, Backend(chat), proxy_evaluator_keys=[EVALUATOR])
    proxy = app.state.proxy

    async def main() -> None:
        await proxy.pool.start()
        http = asgi(app)
        ro = await new_rollout(http)
        rid, ev = ro["rollout_id"], {"Authorization": f"Bearer {EVALUATOR}"}
        stage = {"events": [{"type": "stage", "stage": "eval", "phase": "started"}]}
        ok: list[Any] = [
            await http.post(f"/v1/rollouts/{rid}/events", json=stage, headers=ev),
            await http.post(f"/v1/rollouts/{rid}/rewards", json={"value": 1.0}, headers=ev),
            await http.get(f"/v1/rollouts/{rid}", headers=ev),
            await http.post(f"/v1/rollouts/{rid}/finish", json={"status": "completed"}, headers=ev),
        ]
        assert [r.status_code for r in ok] == [200, 200, 200, 200], [r.text for r in ok]
        refused = {
            "create": await http.post("/v1/rollouts", json={"task_id": "t"}, headers=ev),
            "pause": await http.post("/v1/admin/pause", headers=ev),
            "status": await http.get("/v1/admin/status", headers=ev),
            "jobs": await http.get("/v1/jobs", headers=ev),
        }
        assert {k: r.status_code for k, r in refused.items()} == dict.fromkeys(refused, 401)
        other = await new_rollout(http)
        client = openai.AsyncOpenAI(base_url=other["base_url"], api_key=EVALUATOR, max_retries=0,
                                    http_client=sdk_asgi(app))  # fmt: skip
        with pytest.raises(openai.AuthenticationError):  # no model calls with it
            await client.chat.completions.create(model="m", messages=USER)
        await proxy.pool.aclose()

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        recorder.close(5)


def test_the_key_file_gives_each_proxy_role_its_own_key(tmp_path: Path) -> None:
    create_keys(tmp_path)
    ring = read_keys(tmp_path)
    s = ProxySettings(home=tmp_path)
    admin, evaluator = (
        ring.get("admin").get_secret_value(),
        ring.get("evaluator").get_secret_value(),
    )
    assert [k.get_secret_value() for k in s.proxy_api_keys] == [admin]
    assert [k.get_secret_value() for k in s.proxy_evaluator_keys] == [evaluator]
