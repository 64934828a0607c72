"""How long the web UI's tree viewer takes to open a 1,000-call trajectory in a real browser.

A chDB store holds one rollout of N LLM calls (an agent loop with a retry branch every 10
calls, a rewind every 25 and a tool call per call, rebuilt by the real stream core); the
analytics server serves it; Debian's chromium (headless, Playwright) opens
``/ui/#/rollout/<id>`` and waits until the tree and the token view of the last call are drawn.
Prints the median and all load times (each a fresh page load, cache off).

    .venv/bin/python bench/bench_ui.py [--calls 1000] [--loads 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
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
    Codec,
    Event,
    LlmCall,
    RolloutFinished,
    RolloutStarted,
    ToolCall,
    Trajectory,
)
from rollstream.streams.batch import process_batch

T0 = 1_764_633_600_000_000
RID = "bench-tree"


def events(n_calls: int) -> list[Event]:
    rng = np.random.default_rng(0)
    bodies: list[Any] = [RolloutStarted("bench", "g", group_size=1)]
    full: dict[str, int] = {}
    prev, parent_of_prev = None, None
    for i in range(n_calls):
        cid = f"c{i}"
        parent, q = prev, full.get(prev or "", 0)
        if i and i % 10 == 0 and parent_of_prev:  # a retry: sibling of the previous call
            parent, q = parent_of_prev, full[parent_of_prev]
        elif i and i % 25 == 0:  # a rewind to half of the previous sequence
            q = max(1, q // 2)
        n_prompt, n_completion = (40 if not parent else 12), 30
        bodies.append(LlmCall(cid, parent, q if parent else 0,
                              rng.integers(100, 30_000, n_prompt, dtype=np.uint32),
                              rng.integers(100, 30_000, n_completion, dtype=np.uint32),
                              -rng.random(n_completion, dtype=np.float32)))  # fmt: skip
        bodies.append(ToolCall(f"t{i}", "bash", '{"cmd": "ls"}', "ok", at_call_id=cid))
        full[cid] = (q if parent else 0) + n_prompt + n_completion
        parent_of_prev, prev = parent, cid
    bodies.append(RolloutFinished("completed"))
    return [Event(f"e{i}", RID, i, T0 + i * 1000, b) for i, b in enumerate(bodies)]


def build(path: Path, n_calls: int) -> None:
    client = connect(f"chdb://{path}")
    db = database_for("bench")
    apply_migrations(client, db)
    evs = events(n_calls)
    out = process_batch(evs)
    ev, tr = RowBatch("rollout.events", 0), RowBatch("trajectories", 0)
    for e in evs:
        ev.add(e, len(ev))
    for i, o in enumerate(out.trajectories):
        tr.add(Codec().decode(o.value, Trajectory), i, timestamp_us=T0)
    for b in (ev, tr):
        insert_batch(client, b.tables, b.token, database=db)
    client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--loads", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp), args.calls)
        server = serve(AnalyticsSettings(clickhouse_url=f"chdb://{tmp}", namespace="bench",
                                         analytics_port=0))  # fmt: skip
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True)
                times = []
                for _ in range(args.loads + 1):  # the first load warms the server
                    context = browser.new_context(viewport={"width": 1400, "height": 1000})
                    page = context.new_page()
                    t0 = time.perf_counter()
                    page.goto(f"{server.url}/ui/#/rollout/{RID}")
                    page.wait_for_selector("#tokens .tok", timeout=60_000)
                    nodes = page.locator("#tree-svg .node").count()
                    times.append(time.perf_counter() - t0)
                    context.close()
                browser.close()
        finally:
            server.stop()
    loads = times[1:]
    print(f"{args.calls} calls, {nodes} tree nodes drawn; open to tree + tokens drawn: "
          f"median {statistics.median(loads):.3f} s over {len(loads)} loads "
          f"({', '.join(f'{t:.3f}' for t in loads)})")  # fmt: skip


if __name__ == "__main__":
    main()
