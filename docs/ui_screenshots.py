"""Screenshots of the web UI for docs/ui.md: a chDB store with a demo-like run (4 tasks x 4
samples over 3 policy versions, branching agent trees with tool calls, rewinds and subagents,
rollout-service stages, trainer steps), the analytics server, and Debian's chromium driven by
Playwright. Writes docs/ui/*.png.

    .venv/bin/python docs/ui_screenshots.py [--out docs/ui]
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from playwright.sync_api import sync_playwright

from rollstream.consumers.analytics.server import serve
from rollstream.consumers.analytics.settings import AnalyticsSettings
from rollstream.consumers.store.chstore import connect, database_for, insert_batch
from rollstream.consumers.store.migrations import apply_migrations
from rollstream.consumers.store.rows import RowBatch
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

T0 = 1_764_633_600_000_000  # 2025-12-02 UTC
S = 1_000_000
KEY = "demo-key"
TOOLS = [("bash", '{"cmd": "pytest -q"}', "3 passed, 1 failed in 0.41s"),
         ("read_file", '{"path": "src/parse.py"}', "def parse(text):\n    ..."),
         ("python", '{"code": "print(sum(range(10)))"}', "45")]  # fmt: skip


def _call(rng: random.Random, cid: str, parent: str | None, prefix: int, version: int,
          n_prompt: int, n_completion: int, drift: int = 0) -> LlmCall:  # fmt: skip
    return LlmCall(
        cid, parent, prefix,
        np.array([rng.randrange(100, 30_000) for _ in range(n_prompt)], np.uint32),
        np.array([rng.randrange(100, 30_000) for _ in range(n_completion)], np.uint32),
        np.array([-abs(rng.gauss(0, 0.6)) for _ in range(n_completion)], np.float32),
        model="qwen-tiny", backend=f"b{rng.randrange(2)}", policy_version=version,
        latency_ms=rng.uniform(40, 400), drift_tokens=drift,
    )  # fmt: skip


def agent_rollout(rng: random.Random, rid: str, version: int, start: int) -> list[Any]:
    """An agent loop: appends with tool calls, now and then a retry branch, a rewind
    (summarized context) or a subagent."""
    bodies: list[Any] = []
    full: dict[str, int] = {}
    prev: str | None = None
    prefix = 0
    last_parent: str | None = None
    for i in range(rng.randrange(3, 8)):
        cid = f"{rid}-c{i}"
        kind = rng.random()
        parent, q = prev, prefix
        if i >= 2 and kind < 0.15 and last_parent:  # retry: a sibling of the previous call
            parent = last_parent
            q = full[parent]
            bodies.append(Branch(f"{rid}-b{i}", "retry", parent, "tool error"))
        elif i >= 2 and kind < 0.25 and prev:  # rewind into the previous call's sequence
            q = max(1, full[prev] // 2)
        elif i >= 2 and kind < 0.32:  # subagent: a fresh context
            q = 0
        call = _call(rng, cid, parent, q, version, rng.randrange(8, 40) if q else 60,
                     rng.randrange(10, 60), drift=2 if rng.random() < 0.1 else 0)  # fmt: skip
        bodies.append(call)
        full[cid] = q + len(call.prompt_delta) + len(call.completion_ids)
        last_parent = parent
        name, args, result = rng.choice(TOOLS)
        bodies.append(ToolCall(f"{cid}-t", name, args, result, is_error=rng.random() < 0.1,
                               duration_ms=rng.uniform(5, 900), at_call_id=cid))  # fmt: skip
        if rng.random() < 0.3:
            bodies.append(Reward(0.25, "milestone", "tests_run", at_call_id=cid))
        prev, prefix = cid, full[cid]
    return bodies


def demo_events(seed: int = 7) -> list[Event]:
    rng = random.Random(seed)
    events: list[Event] = []
    k = 0
    for version in range(3):
        for task in ("parse-dates", "fix-off-by-one", "sql-join", "regex-email"):
            grp = f"{task}-v{version}"
            for sample in range(4):
                rid = f"{grp}-s{sample}"
                job = f"job-{version}"
                start = T0 + k * 20 * S
                k += 1
                running = version == 2 and sample == 3
                bodies: list[Any] = [
                    RolloutStarted(task, grp, policy_version=version, group_size=4),
                    StageEvent("init", "started", job_id=job, worker="w1"),
                    StageEvent("init", "finished", "ok", rng.uniform(200, 900), job, "w1"),
                    StageEvent("run", "started", job_id=job, worker="w2"),
                    *agent_rollout(rng, rid, version, start),
                ]
                if not running:
                    failed = rng.random() < 0.1
                    bodies.append(StageEvent("run", "finished", "failed" if failed else "ok",
                                             rng.uniform(2_000, 20_000), job, "w2"))  # fmt: skip
                    if not failed:
                        bodies += [StageEvent("eval", "started", job_id=job, worker="w3"),
                                   StageEvent("eval", "finished", "ok", rng.uniform(50, 600),
                                              job, "w3")]  # fmt: skip
                        p = 0.35 + 0.2 * version
                        bodies.append(Reward(1.0 if rng.random() < p else 0.0, "final", "pass"))
                    bodies.append(RolloutFinished("failed" if failed else "completed"))
                events += [Event(f"{rid}-e{i}", rid, i, start + i * S // 4, b)
                           for i, b in enumerate(bodies)]  # fmt: skip
    return events


def build_store(path: Path, namespace: str) -> None:
    client = connect(f"chdb://{path}")
    db = database_for(namespace)
    apply_migrations(client, db)
    events = demo_events()
    finished = {e.rollout_id for e in events if isinstance(e.body, RolloutFinished)}
    out = process_batch([e for e in events if e.rollout_id in finished])
    codec = Codec()
    rng = random.Random(3)
    ev, tr, sa, pv = (RowBatch(t, 0) for t in ("rollout.events", "trajectories", "samples",
                                                "policy.versions"))  # fmt: skip
    for e in events:
        ev.add(e, len(ev))
    for i, o in enumerate(out.trajectories):
        tr.add(codec.decode(o.value, Trajectory), i, timestamp_us=T0)
    for i, o in enumerate(out.samples):
        s = codec.decode(o.value, Sample)
        arrival = s.policy_version * 100 + 50 + rng.randrange(150)  # 0-2 versions behind
        sa.add(s, i, timestamp_us=T0 + arrival * S)
    for v in range(1, 13):
        metrics = {"loss": 0.6 * 0.85**v + rng.uniform(-0.03, 0.03),
                   "clip_frac": 0.12 * 0.9**v + rng.uniform(0, 0.01),
                   "approx_kl": 0.004 + 0.002 * rng.random(), "grad_norm": 1.4 - 0.05 * v,
                   "step_time_s": 2.5 + rng.uniform(-0.3, 0.3), "dlq": float(v > 8)}  # fmt: skip
        pv.add(PolicyVersion(v, f"ckpt/{v}", v, T0 + v * 100 * S, 32 * v, metrics), v)
    for b in (ev, tr, sa, pv):
        insert_batch(client, b.tables, b.token, database=db)
    client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "ui")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        build_store(Path(tmp), "demo")
        server = serve(AnalyticsSettings(clickhouse_url=f"chdb://{tmp}", namespace="demo",
                                         analytics_port=0, analytics_api_keys=KEY))  # fmt: skip
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True)
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"{server.url}/ui/")
                page.fill("#key", KEY)
                page.click("#keyform button")
                shots = {
                    "dashboard": ("#/", "body[data-loaded=dashboard]"),
                    "rollouts": ("#/rollouts?policy_version=1", "#rollouts-table"),
                    "group": ("#/group/sql-join-v1", "#group-rollouts"),
                    "trajectory": (f"#/rollout/{_branchy(tmp)}", "#tokens"),
                    "training": ("#/training", "body[data-loaded=training]"),
                }
                for name, (where, ready) in shots.items():
                    page.goto(f"{server.url}/ui/{where}")
                    page.wait_for_selector(ready, timeout=30_000)
                    page.wait_for_timeout(300)
                    page.screenshot(path=str(args.out / f"{name}.png"), full_page=name != "group")
                    print(args.out / f"{name}.png")
                browser.close()
        finally:
            server.stop()


def _branchy(_tmp: str) -> str:
    """The demo rollout with the most kinds of links (retry, rewind or subagent)."""
    best, score = "", -1
    by_rollout: dict[str, set[str]] = {}
    for e in demo_events():
        kinds = by_rollout.setdefault(e.rollout_id, set())
        if isinstance(e.body, Branch):
            kinds.add("retry")
        elif isinstance(e.body, LlmCall) and e.body.parent_call_id:
            kinds.add("subagent" if e.body.prefix_len == 0 else "call")
    for rid, kinds in sorted(by_rollout.items()):
        if len(kinds) > score:
            best, score = rid, len(kinds)
    return best


if __name__ == "__main__":
    main()
