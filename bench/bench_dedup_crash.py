"""Is ClickHouse's insert deduplication crash-safe? (why the sink verifies re-read batches)

A child process inserts numbered 2,000-row blocks into a chDB ReplacingMergeTree, each with
``insert_deduplication_token = 't<i>'``, and prints each block it finished. The parent SIGKILLs
it at a random moment, then starts a new child that re-inserts from two blocks before the last
finished one, with the same tokens — what a consumer does with uncommitted batches. At the end
every block below the restart point was reported finished by some child; a block with no rows
is a batch lost although its insert "succeeded": its token reached the deduplication log and
its part did not reach the table, so the retry was dropped.

    .venv/bin/python bench/bench_dedup_crash.py [--quick] [--kills 60]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import sys
from chdb import session
s = session.Session(sys.argv[1])
s.query("CREATE DATABASE IF NOT EXISTS d")
s.query("CREATE TABLE IF NOT EXISTS d.t (i UInt64, j UInt64) ENGINE = ReplacingMergeTree "
        "ORDER BY (i, j) SETTINGS non_replicated_deduplication_window = 10000")
print("ready", flush=True)
i = int(sys.argv[2])
while True:
    s.query(f"INSERT INTO d.t SETTINGS insert_deduplication_token = 't{i}' "
            f"SELECT {i}, number FROM numbers(2000)")
    print(f"done {i}", flush=True)
    i += 1
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="15 kills")
    ap.add_argument("--kills", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    kills = 15 if args.quick else args.kills
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="bench-dedup-"))
    path = str(work / "db")
    restart = 0
    t0 = time.monotonic()
    try:
        for _ in range(kills):
            child = subprocess.Popen(
                [sys.executable, "-c", CHILD, path, str(restart)], stdout=subprocess.PIPE, text=True
            )
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, 0.3))
            child.send_signal(signal.SIGKILL)
            out = child.stdout.read()
            child.wait()
            done = [int(line.split()[1]) for line in out.splitlines() if line.startswith("done")]
            last = max(done) if done else restart - 1
            restart = max(0, last - 1)  # redo two finished blocks, as after an uncommitted batch
        from chdb import session

        rows = session.Session(path).query("SELECT i, count() FROM d.t GROUP BY i", "CSV")
        counts = {int(a): int(b) for a, b in (r.split(",") for r in rows.bytes().decode().split())}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lost = [i for i in range(restart) if counts.get(i, 0) == 0]
    short = [i for i, n in counts.items() if n not in (0, 2000)]
    print(f"{kills} kills, {restart} blocks finished, lost: {lost or 'none'}, "
          f"partial: {short or 'none'} ({time.monotonic() - t0:.0f} s)")  # fmt: skip
    print(json.dumps({"kills": kills, "blocks": restart, "lost_blocks": len(lost),
                      "lost": lost, "partial_blocks": len(short)}))  # fmt: skip


if __name__ == "__main__":
    main()
