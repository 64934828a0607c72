"""How long the web UI's tree viewer takes to open a 1,000-call trajectory in a real browser.

A chDB store holds one rollout of N LLM calls (an agent loop with a retry branch every 10
calls, a rewind every 25 and a tool call per call, rebuilt by the real stream core); the
analytics server serves it; Debian's chromium (headless, Playwright) opens
``/ui/#/rollout/<id>`` and waits until the tree and the token view of the last call are drawn.
Each load is a fresh browser context (cache off).

Each load's time is split with the page's own clocks (Resource Timing):
- ``open``: wall time from ``goto`` until Playwright sees the first token drawn;
- ``page``: navigation start to the first token in the DOM (a MutationObserver in the page);
- ``server``: the time some ``/ui/api/`` request was in flight (requests may overlap);
- ``browser``: ``page`` minus ``server`` (static files, script, DOM, layout, paint);
- ``trajectory`` / ``tokens``: each endpoint's request start to response end;
and, between loads, ``endpoint``: the trajectory endpoint run in this process on the server's
own client (queries + assembly + JSON encoding, no HTTP).

``--before REF`` also loads the UI's static files as they were at git REF (the browser is
handed them instead of the server's, same server, same data), alternating loads with the
current files, so both columns come from one run on the same (shared) machine.

    .venv/bin/python bench/bench_ui.py [--calls 1000] [--loads 5] [--before HEAD]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from playwright.sync_api import Browser, Route, sync_playwright

from rollstream.consumers.analytics import ui_api
from rollstream.consumers.analytics.server import AnalyticsServer, serve, ui_data
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
NAMESPACE = "bench"
UI_FILES = ("index.html", "app.js", "style.css")
UI_PATH = "consumers/analytics/ui"
# in the page from its first script on: the time the first token is in the DOM
DRAWN_PROBE = """new MutationObserver((_, obs) => {
  if (document.querySelector('#tokens .tok')) {
    window.__drawn = performance.now();
    obs.disconnect();
  }
}).observe(document, { childList: true, subtree: true });"""
TIMINGS = """() => {
  const api = performance.getEntriesByType('resource').filter((e) => e.name.includes('/ui/api/'));
  const spans = api.map((e) => [e.startTime, e.responseEnd]).sort((a, b) => a[0] - b[0]);
  let busy = 0, end = -1;
  for (const [a, b] of spans) { if (b > end) { busy += b - Math.max(a, end); end = b; } }
  const one = (name) => { const e = api.find((x) => x.name.includes(`/ui/api/${name}`));
                          return e ? e.responseEnd - e.startTime : null; };
  const svg = document.querySelector('#tree-svg');
  return { page: window.__drawn, server: busy, trajectory: one('trajectory'),
           tokens: one('tokens'), nodes_in_dom: document.querySelectorAll('#tree-svg .node').length,
           nodes: svg && svg.dataset.nodes ? Number(svg.dataset.nodes)
                                           : document.querySelectorAll('#tree-svg .node').length };
}"""


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
    db = database_for(NAMESPACE)
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


def files_at(ref: str) -> dict[str, bytes]:
    """The UI's static files as they were at git ``ref``."""
    root = Path(__file__).resolve().parent.parent
    return {
        name: subprocess.run(["git", "show", f"{ref}:{UI_PATH}/{name}"], cwd=root,
                             check=True, capture_output=True).stdout
        for name in UI_FILES
    }  # fmt: skip


def load(browser: Browser, url: str, files: dict[str, bytes] | None) -> dict[str, Any]:
    """One fresh load of the tree viewer; ``files`` replace the server's static UI files."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.add_init_script(DRAWN_PROBE)
    if files is not None:
        kinds = {"html": "text/html", "js": "text/javascript", "css": "text/css"}

        def fulfill(route: Route) -> None:
            name = route.request.url.split("?")[0].rsplit("/", 1)[-1] or "index.html"
            route.fulfill(body=files[name], content_type=kinds[name.rsplit(".", 1)[-1]])

        context.route(lambda u: u.split("?")[0].endswith(("/ui/", *UI_FILES)), fulfill)
    page = context.new_page()
    t0 = time.perf_counter()
    page.goto(f"{url}/ui/#/rollout/{RID}")
    page.wait_for_selector("#tokens .tok", timeout=60_000)
    wall = time.perf_counter() - t0
    t = page.evaluate(TIMINGS)
    context.close()
    return {"open": wall * 1000, **t, "browser": t["page"] - t["server"]}


def endpoint_ms(server: AnalyticsServer) -> float:
    """The trajectory endpoint in this process: queries, assembly and JSON encoding."""
    spec = ui_api.ENDPOINTS["trajectory"]
    params = ui_api.parse_params(spec, [("rollout", RID)])
    t = time.perf_counter()
    orjson.dumps(server.store.call(ui_data, spec, params, database_for(NAMESPACE)),
                 option=orjson.OPT_SERIALIZE_NUMPY, default=str)  # fmt: skip
    return (time.perf_counter() - t) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--loads", type=int, default=5)
    parser.add_argument("--before", metavar="REF", help="also time the UI files at git REF")
    args = parser.parse_args()
    variants: dict[str, dict[str, bytes] | None] = {"now": None}
    if args.before:
        variants = {f"at {args.before}": files_at(args.before), "now": None}
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    endpoint: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp), args.calls)
        server = serve(AnalyticsSettings(clickhouse_url=f"chdb://{tmp}", namespace=NAMESPACE,
                                         analytics_port=0))  # fmt: skip
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True)
                for i in range(args.loads + 1):  # the first round warms the server
                    for name, files in variants.items():  # alternating: same conditions
                        r = load(browser, server.url, files)
                        if i:
                            runs[name].append(r)
                    endpoint.append(endpoint_ms(server))
                browser.close()
        finally:
            server.stop()
    keys = ("open", "page", "server", "browser", "trajectory", "tokens")
    inproc = statistics.median(endpoint[1:])
    print(f"{args.calls} calls; medians of {args.loads} loads, ms "
          f"(trajectory endpoint in process: {inproc:.0f} ms)")  # fmt: skip
    print(f"{'':>12}" + "".join(f"{k:>12}" for k in keys) + f"{'nodes in DOM':>15}")
    for name, rs in runs.items():
        med = [statistics.median(r[k] for r in rs) for k in keys]
        print(f"{name:>12}" + "".join(f"{m:>12.0f}" for m in med)
              + f"{rs[-1]['nodes_in_dom']:>9} of {rs[-1]['nodes']}")  # fmt: skip
        print(f"{'':>12} open: " + ", ".join(f"{r['open']:.0f}" for r in rs))


if __name__ == "__main__":
    main()
