"""The web UI in a real browser (Debian's chromium, headless, driven by Playwright) against the
analytics server on a real chDB store.

The events of a small run (two groups, a known branching rollout with a rewind, a subagent, a
retry branch, a tool call, rewards at calls and a call with retokenization drift) go through
the real stream core (``process_batch``: trajectories, advantages, samples) and the real row
mapping into the store; the trainer's policy versions carry step metrics. The tests drive the
pages as a user would and read what they show.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from playwright.sync_api import Browser, Page, expect, sync_playwright

from rollstream.adapters.topics import ensure_topics
from rollstream.consumers.analytics.server import AnalyticsServer, serve
from rollstream.consumers.analytics.settings import AnalyticsSettings
from rollstream.consumers.store.chstore import connect, database_for, insert_batch
from rollstream.consumers.store.migrations import apply_migrations
from rollstream.consumers.store.rows import RowBatch
from rollstream.infra.kafka import KafkaBroker
from rollstream.schemas import (
    Branch,
    Codec,
    Event,
    LlmCall,
    PolicyVersion,
    Reward,
    RolloutFinished,
    RolloutStarted,
    Sample,
    StageEvent,
    ToolCall,
    Trajectory,
)
from rollstream.streams.batch import process_batch

pytestmark = pytest.mark.integration

KEY = "ui-analyst-key"
NAMESPACE = f"ui{uuid.uuid4().hex[:6]}"
T0 = 1_767_225_600_000_000  # 2026-01-01 UTC
S = 1_000_000
CHROMIUM = "/usr/bin/chromium"


def _call(cid: str, parent: str | None, prefix: int, prompt: list[int], completion: list[int],
          drift: int = 0) -> LlmCall:  # fmt: skip
    return LlmCall(
        cid, parent, prefix, np.array(prompt, np.uint32), np.array(completion, np.uint32),
        np.array([-0.125 * (i + 1) for i in range(len(completion))], np.float32),
        backend="b0", latency_ms=40.0, drift_tokens=drift,
    )  # fmt: skip


def branching_rollout() -> list[Any]:
    """rb: c1 (root); c2 appends to c1; c3 branches off c1 where c2 did (retry); c4 names c2
    but rewinds into c1's tokens; c5 is a subagent (names c2, starts a new context)."""
    return [
        _call("c1", None, 0, [1, 2, 3], [10, 11]),
        _call("c2", "c1", 5, [4], [12, 13]),
        ToolCall("t1", "bash", '{"cmd": "ls"}', "main.py\n<b>not bold</b>", at_call_id="c2"),
        _call("c3", "c1", 5, [5, 6], [14]),
        Branch("b1", "retry", "c1", "first answer failed"),
        _call("c4", "c2", 4, [7], [15, 16], drift=2),
        _call("c5", "c2", 0, [20, 21], [22]),
        Reward(0.5, "partial", "tests", at_call_id="c2"),
        Reward(1.0, "final", "pass", at_call_id="c3"),
    ]


# rollout: (task, group, policy version, job, final reward or None, status or None: running)
ROLLOUTS = {
    "rb": ("A", "gA", 0, "j1", 1.0, "completed"),
    "r2": ("A", "gA", 0, "j1", 0.0, "completed"),
    "r3": ("A", "gA", 1, "j1", 0.5, "completed"),
    "r4": ("B", "gB", 1, "j2", None, None),
    "r5": ("B", "gB", 1, "j2", None, "failed"),
}


def rollout_events(rid: str, index: int) -> list[Event]:
    task, grp, version, job, reward, status = ROLLOUTS[rid]
    bodies: list[Any] = [RolloutStarted(task, grp, policy_version=version, group_size=3)]
    bodies += [StageEvent("init", "started", job_id=job, worker="w"),
               StageEvent("init", "finished", "ok", 100.0 * (index + 1), job, "w"),
               StageEvent("run", "started", job_id=job, worker="w")]  # fmt: skip
    if rid == "rb":
        bodies += branching_rollout()
    else:
        bodies.append(_call(f"{rid}c1", None, 0, [1, 2], [30 + index]))
        if reward is not None:
            bodies.append(Reward(reward))
    if status is not None:
        bodies.append(StageEvent("run", "finished", "ok", 1000.0, job, "w"))
        bodies.append(RolloutFinished(status))
    start = T0 + index * 10 * S
    return [Event(f"{rid}e{i}", rid, i, start + i * S, b) for i, b in enumerate(bodies)]


def store_run(client: Any, db: str, events: list[Event], first: int) -> dict[str, Any]:
    """Events, and what the stream core makes of them, into the store (as the sink would).
    The core sees the finished rollouts only: a live processor has not closed the others yet
    (at the end of its input the batch path would close them as truncated)."""
    codec = Codec()
    finished = {e.rollout_id for e in events if isinstance(e.body, RolloutFinished)}
    out = process_batch([e for e in events if e.rollout_id in finished])
    trajectories = [codec.decode(o.value, Trajectory) for o in out.trajectories]
    samples = [codec.decode(o.value, Sample) for o in out.samples]
    ev = RowBatch("rollout.events", 0)
    for e in events:
        ev.add(e, first + len(ev))
    tr = RowBatch("trajectories", 0)
    for i, t in enumerate(trajectories):
        tr.add(t, first + i, timestamp_us=T0)
    sa = RowBatch("samples", 0)
    for i, s in enumerate(samples):
        sa.add(s, first + i, timestamp_us=T0 + 300 * S)
    for b in (ev, tr, sa):
        insert_batch(client, b.tables, b.token, database=db)
    return {"trajectories": trajectories, "samples": samples}


STEPS = [(1, {"loss": 0.5, "clip_frac": 0.125, "approx_kl": 0.01, "grad_norm": 1.5,
              "step_time_s": 2.0, "dlq": 0.0}),
         (2, {"loss": 0.25, "clip_frac": 0.0625, "approx_kl": 0.02, "grad_norm": 0.75,
              "step_time_s": 1.5, "dlq": 3.0})]  # fmt: skip


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Any, dict[str, Any]]]:
    path = tmp_path_factory.mktemp("chdb-ui")
    writer = connect(f"chdb://{path}")
    db = database_for(NAMESPACE)
    apply_migrations(writer, db)
    events = [e for i, rid in enumerate(ROLLOUTS) for e in rollout_events(rid, i)]
    made = store_run(writer, db, events, 0)
    store_run(writer, db, events, 10_000)  # again, re-batched: every page reads past duplicates
    pv = RowBatch("policy.versions", 0)
    for version, metrics in STEPS:
        pv.add(PolicyVersion(version, f"ckpt/{version}", version, T0 + version * 100 * S,
                             32 * version, metrics), version)  # fmt: skip
    insert_batch(writer, pv.tables, pv.token, database=db)
    yield path, writer, made
    writer.close()


@pytest.fixture(scope="module")
def server(
    store: tuple[Path, Any, dict[str, Any]], kafka: KafkaBroker
) -> Iterator[AnalyticsServer]:
    settings = AnalyticsSettings(
        clickhouse_url=f"chdb://{store[0]}",
        kafka_bootstrap=kafka.bootstrap,  # the dashboard's consumer lag
        namespace=NAMESPACE,
        analytics_port=0,
        analytics_api_keys=KEY,
    )
    srv = serve(settings)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser: Browser, server: AnalyticsServer) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.goto(f"{server.url}/ui/")
    pg.fill("#key", KEY)  # the page asks for the key once, on the first 401
    pg.click("#keyform button")
    yield pg
    context.close()
    assert errors == [], errors


def cells(page: Page, table: str, column: str) -> list[str]:
    return page.locator(f"#{table} td[data-col='{column}']").all_inner_texts()


# --- HTTP -----------------------------------------------------------------------------------


def test_static_files_are_open_and_data_wants_the_key(server: AnalyticsServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        for path in ("/ui/", "/ui/app.js", "/ui/style.css"):
            assert anon.get(path).status_code == 200, path
        assert '<script src="app.js">' in anon.get("/ui/").text
        r = anon.get("/ui/api/rollouts")
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        auth = {"Authorization": f"Bearer {KEY}"}
        bad = {
            "/ui/api/rollouts?limit=5000": "limit",
            "/ui/api/rollouts?status=exploded": "status",
            "/ui/api/rollouts?min_reward=abc": "min_reward",
            "/ui/api/rollouts?policy_version=1&policy_version=2": "policy_version",
            "/ui/api/rollouts?nonsense=1": "nonsense",
            "/ui/api/trajectory": "rollout",
            f"/ui/api/trajectory?rollout={'x' * 300}": "rollout",
            "/ui/api/trajectory?rollout=nope": "rollout",
            "/ui/api/tokens?rollout=rb&call=zz": "call",
            "/ui/api/group?group=gA&namespace=other": "namespace",
        }
        for path, field in bad.items():
            r = anon.get(path, headers=auth)
            assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
            assert field in r.json()["error"], (path, r.text)
        assert anon.get("/ui/api/nothing", headers=auth).status_code == 404
        steps = anon.get("/reports/train_steps", headers=auth).json()
        assert [r[steps["columns"].index("loss")] for r in steps["rows"]] == [0.5, 0.25]


# --- the pages ------------------------------------------------------------------------------


def test_dashboard_shows_the_numbers(page: Page) -> None:
    expect(page.locator("body")).to_have_attribute("data-loaded", "dashboard", timeout=30_000)
    kpi = page.locator("[data-kpi='rollouts'] .v")
    expect(kpi).to_have_text("5")
    expect(page.locator("[data-kpi='running'] .v")).to_have_text("1")
    # finished: rb 1.0, r2 0.0 (v0); r3 0.5, r5 failed without a final reward: 0 (v1)
    assert cells(page, "reward-table", "policy_version") == ["0", "1"]
    assert cells(page, "reward-table", "mean_reward") == ["0.5", "0.25"]
    assert cells(page, "reward-table", "pass_rate") == ["50.0%", "0.0%"]
    status = dict(zip(cells(page, "status-table", "status"),
                      cells(page, "status-table", "rollouts"), strict=True))  # fmt: skip
    assert status == {"completed": "3", "failed": "1", "running": "1"}
    assert cells(page, "stages-table", "job_id") == ["j1", "j1", "j2", "j2"]
    assert cells(page, "dlq-table", "n")[1] == "3"  # the trainer's DLQ counter, latest step
    assert page.locator("svg polyline").count() >= 2  # the line charts were drawn
    calls = [e.body for e in all_events() if isinstance(e.body, LlmCall)]
    tokens = sum(len(c.completion_ids) for c in calls)
    expect(page.locator("#throughput-note")).to_contain_text(f"{len(calls)} calls and {tokens} ")
    expect(page.locator("[data-kpi='tokens/s (last 5 min)'] .v")).not_to_have_text("\u2013")
    expect(page.locator("#lag-table")).to_be_visible()  # the broker answers: a table, no error


def all_events() -> list[Event]:
    return [e for i, rid in enumerate(ROLLOUTS) for e in rollout_events(rid, i)]


def test_throughput_counts_each_call_once(server: AnalyticsServer) -> None:
    # every call is within 5 minutes of the newest one, and stored twice (re-batched): FINAL
    calls = [e.body for e in all_events() if isinstance(e.body, LlmCall)]
    tokens = sum(len(c.completion_ids) for c in calls)
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, timeout=30, headers=auth) as http:
        got = http.get("/ui/api/throughput").json()
        assert (got["recent_calls"], got["recent_tokens"]) == (len(calls), tokens)
        assert got["tokens_per_s"] == pytest.approx(tokens / 300)
        assert sum(m["calls"] for m in got["minutes"]) == len(calls)
        assert sum(m["completion_tokens"] for m in got["minutes"]) == tokens
        r = http.get("/ui/api/throughput?minutes=0")
        assert r.status_code == 400 and "minutes" in r.json()["error"]


def test_consumer_lag_of_the_namespace_groups(server: AnalyticsServer, kafka: KafkaBroker) -> None:
    settings = AnalyticsSettings(kafka_bootstrap=kafka.bootstrap, namespace=NAMESPACE)
    topic = settings.topics().events
    ensure_topics(settings)
    producer = Producer(settings.kafka_config())
    for i in range(5):
        producer.produce(topic, value=b"x%d" % i, partition=0)
    assert producer.flush(30) == 0
    group = f"{NAMESPACE}.rollstream-sink-v1"
    consumer = Consumer({**settings.kafka_config(), "group.id": group})
    consumer.commit(offsets=[TopicPartition(topic, 0, 2)], asynchronous=False)
    consumer.close()
    other = Consumer({**settings.kafka_config(), "group.id": "elsewhere.rollstream-sink-v1"})
    other.commit(offsets=[TopicPartition(topic, 0, 1)], asynchronous=False)  # not this namespace
    other.close()
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, timeout=30, headers=auth) as http:
        deadline = time.monotonic() + 30
        while True:  # the server reads Kafka at most every 5 s
            got = http.get("/ui/api/lag").json()
            if got["groups"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert got["error"] is None
        assert got["groups"] == [{"group": group, "topic": topic, "partitions": 1, "lag": 3}]
        assert http.get("/ui/api/lag?namespace=other").status_code == 403
        assert httpx.get(f"{server.url}/ui/api/lag").status_code == 401


def test_rollout_filters(page: Page) -> None:
    ids = page.locator("#rollouts-table td[data-col='rollout_id']")  # newest start first
    home = page.url.split("#")[0]
    page.goto(home + "#/rollouts")
    expect(ids).to_have_text(["r5", "r4", "r3", "r2", "rb"], timeout=30_000)
    expect(page.locator("#total")).to_have_text("5 rollouts match")
    page.select_option("#filters select[name=status]", "failed")
    page.click("#filters button")
    expect(ids).to_have_text(["r5"])
    expect(page.locator("#total")).to_have_text("1 rollouts match")
    page.goto(home + "#/rollouts?task=A&min_reward=0.4")
    expect(ids).to_have_text(["r3", "rb"])
    expect(page.locator("#filters select[name=task]")).to_have_value("A")
    page.goto(home + "#/rollouts?job=j2&policy_version=1")
    expect(ids).to_have_text(["r5", "r4"])
    page.goto(home + "#/rollouts?group=gA&max_reward=0.5")
    expect(ids).to_have_text(["r3", "r2"])
    page.goto(home + "#/rollouts?max_reward=-1")
    expect(page.locator("#total")).to_have_text("0 rollouts match")
    expect(ids).to_have_count(0)


def test_group_side_by_side_with_advantages(
    page: Page, store: tuple[Path, Any, dict[str, Any]]
) -> None:
    samples = store[2]["samples"]
    expected = {s.rollout_id: s.advantage for s in samples if s.group_id == "gA"}
    assert len(expected) == 3  # the real aggregator closed gA (group_size 3)
    page.goto(page.url.split("#")[0] + "#/group/gA")
    cards = page.locator("#group-rollouts [data-rollout]")
    expect(cards).to_have_count(3, timeout=30_000)
    for rid, adv in expected.items():
        shown = page.locator(f"[data-rollout='{rid}'] [data-field='advantage']").inner_text()
        assert float(shown) == pytest.approx(adv, abs=1e-3), rid
    assert expected["rb"] > 0 > expected["r2"]  # reward 1.0 vs 0.0 in the same group


def test_a_slow_page_left_behind_never_draws_over_the_next(page: Page) -> None:
    """The dashboard's lag answer held back 3 s while the user opens a rollout: when it comes,
    the dashboard (left behind) must not replace the tree viewer."""
    expect(page.locator("body")).to_have_attribute("data-loaded", "dashboard", timeout=30_000)

    def slow(route: Any) -> None:
        time.sleep(3.0)
        route.continue_()

    page.route("**/ui/api/lag*", slow)
    page.goto(page.url.split("#")[0] + "#/")  # the dashboard again, its lag answer slow
    page.goto(page.url.split("#")[0] + "#/rollout/rb?call=c4")
    tree = page.locator("#tree-svg")
    expect(tree.locator(".node")).to_have_count(5, timeout=30_000)
    page.wait_for_timeout(4_000)  # the dashboard's answers are all back by now
    expect(tree.locator(".node[data-call='c3']")).to_have_count(1)
    expect(page.locator("#kpis")).to_have_count(0)  # no dashboard drawn over it
    expect(page.locator("#error")).to_be_hidden()


def test_tree_viewer_shows_the_branching_rollout(
    page: Page, store: tuple[Path, Any, dict[str, Any]]
) -> None:
    page.goto(page.url.split("#")[0] + "#/rollout/rb?call=c4")
    tree = page.locator("#tree-svg")
    expect(tree.locator(".node")).to_have_count(5, timeout=30_000)
    links = {c: tree.locator(f".node[data-call='{c}']").get_attribute("data-link")
             for c in ("c1", "c2", "c3", "c4", "c5")}  # fmt: skip
    assert links == {"c1": "root", "c2": "branch", "c3": "branch", "c4": "rewind",
                     "c5": "subagent"}  # fmt: skip
    assert tree.locator(".node[data-call='c3']").get_attribute("data-rewards") == "1"
    assert tree.locator(".node[data-call='c2']").get_attribute("data-rewards") == "1"
    # the path to c4: c2's sequence cut at 4 tokens (rewind), then c4's prompt and completion
    tokens = page.locator("#tokens .tok")
    expect(tokens).to_have_count(7)
    assert tokens.all_inner_texts() == ["1", "2", "3", "10", "7", "15", "16"]
    assert page.locator("#tokens .tok.m1").all_inner_texts() == ["10", "15", "16"]
    assert page.locator("#tokens .tok.m0").all_inner_texts() == ["1", "2", "3", "7"]
    assert page.locator("#tokens .tok.drift").all_inner_texts() == ["7", "15", "16"]
    assert "logprob -0.125" in (page.locator("#tokens .tok.m1").nth(1).get_attribute("title") or "")
    expect(page.locator("#token-summary")).to_contain_text("3 trained")
    # c2's tool call and its result, escaped; then the subagent's own context
    page.click("#tree-svg .node[data-call='c2']")
    expect(page.locator("#node-detail [data-tool='t1']")).to_contain_text("<b>not bold</b>")
    expect(page.locator("#tokens .tok")).to_have_count(8)
    page.click("#tree-svg .node[data-call='c5']")
    expect(page.locator("#tokens .tok")).to_have_count(3)
    assert page.locator("#tokens .tok.m1").all_inner_texts() == ["22"]
    made = [s for s in store[2]["samples"] if s.rollout_id == "rb"]
    assert page.locator("#samples-table tbody tr").count() == len(made) > 0


def test_training_page(page: Page) -> None:
    page.goto(page.url.split("#")[0] + "#/training")
    expect(page.locator("body")).to_have_attribute("data-loaded", "training", timeout=30_000)
    for metric in ("loss", "clip_frac", "approx_kl", "grad_norm", "step_time_s"):
        assert page.locator(f"[data-metric='{metric}'] polyline").count() == 1, metric
    assert page.locator("[data-metric='entropy']").count() == 0  # not recorded
    assert cells(page, "steps-table", "loss") == ["0.25", "0.5"]


def test_pages_refresh_live(page: Page, store: tuple[Path, Any, dict[str, Any]]) -> None:
    """A rollout arrives while the dashboard is open: it shows without a reload (last: it
    changes the store the other tests read)."""
    kpi = page.locator("[data-kpi='rollouts'] .v")
    expect(kpi).to_have_text("5", timeout=30_000)
    batch = RowBatch("rollout.events", 0)
    batch.add(Event("late-e0", "late", 0, T0 + 99 * S, RolloutStarted("C", "gC")), 50_000)
    insert_batch(store[1], batch.tables, batch.token, database=database_for(NAMESPACE))
    expect(kpi).to_have_text("6", timeout=20_000)
    expect(page.locator("[data-kpi='running'] .v")).to_have_text("2")
