"""Sandbox create+destroy and exec latency: bubblewrap, docker and a bare subprocess, side by side.

Per kind, ``--n`` rounds of ``create(spec)`` (one 1 KB file copied in, as a task would) then
``destroy()``, timed together and apart, and ``--execs`` runs of a trivial ``exec(["true"])`` in
one sandbox (the fixed cost a tool call pays). Kinds: ``bwrap`` (a fresh bubblewrap per exec,
rlimits inside), ``docker`` (a container per sandbox on a private dockerd, started here as in
the tests, overlay2 where the kernel allows, else vfs), ``local`` (a bare subprocess in a temp
dir, no isolation: the floor), and ``subprocess`` (``subprocess.run(["true"])`` alone: what any
exec costs in Python here). One warm-up round per kind is not timed.

    .venv/bin/python bench/bench_sandbox.py [--quick] [--n 200] [--execs 200] [--kinds ...]
        [--docker-url unix:///path/docker.sock]

Figures: one JSON object on the last line (ms; p50/p99 over the rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rollstream.producers.rollouts.docker_sandbox import DockerProvider
from rollstream.producers.rollouts.sandbox import SandboxProvider, SandboxSpec, open_provider

REPO = Path(__file__).resolve().parents[1]


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _ms(xs: list[float]) -> dict[str, float]:
    return {
        "p50": round(1000 * statistics.median(xs), 2),
        "p99": round(1000 * _pct(xs, 0.99), 2),
        "mean": round(1000 * statistics.fmean(xs), 2),
    }


def bench_kind(provider: SandboxProvider, n: int, execs: int) -> dict[str, Any]:
    spec = SandboxSpec(kind=provider.kind, files={"task/input.txt": b"x" * 1024})
    provider.create(spec).destroy()  # warm-up (bwrap's probe, docker's first container)
    create, destroy, both = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = provider.create(spec)
        t1 = time.perf_counter()
        sb.destroy()
        t2 = time.perf_counter()
        create.append(t1 - t0)
        destroy.append(t2 - t1)
        both.append(t2 - t0)
    lat = []
    with provider.create(spec) as sb:
        sb.exec(["true"])
        for _ in range(execs):
            t0 = time.perf_counter()
            r = sb.exec(["true"])
            lat.append(time.perf_counter() - t0)
            assert r.ok, r
    return {
        "create_destroy_ms": _ms(both),
        "create_ms": _ms(create),
        "destroy_ms": _ms(destroy),
        "exec_true_ms": _ms(lat),
        "n": n,
        "execs": execs,
    }


def bench_subprocess(execs: int) -> dict[str, Any]:
    subprocess.run(["true"], check=True)
    lat = []
    for _ in range(execs):
        t0 = time.perf_counter()
        subprocess.run(["true"], check=True, capture_output=True)
        lat.append(time.perf_counter() - t0)
    return {"exec_true_ms": _ms(lat), "execs": execs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small counts, under 30 s")
    ap.add_argument("--n", type=int, default=200, help="create+destroy rounds per kind")
    ap.add_argument("--execs", type=int, default=200, help="trivial execs per kind")
    ap.add_argument("--kinds", default="bwrap,docker,local,subprocess")
    ap.add_argument("--docker-url", help="use this dockerd instead of starting a private one")
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.execs = 15, 30
    kinds = args.kinds.split(",")
    load_start = os.getloadavg()[0]  # the box is shared: say how busy it was
    root = Path(tempfile.mkdtemp(prefix="bench-sandbox-"))
    root.chmod(0o755)  # bwrap, run as an unprivileged user when we are root, must reach it
    daemon = None
    results: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    try:
        for kind in kinds:
            t0 = time.perf_counter()
            if kind == "subprocess":
                results[kind] = bench_subprocess(args.execs)
            elif kind == "docker":
                url = args.docker_url
                if url is None:
                    sys.path.insert(0, str(REPO / "tests" / "integration"))
                    from _dockerd import image_cache, start_dockerd

                    daemon = start_dockerd()
                    url = daemon.base_url
                    extra["docker_storage_driver"] = daemon.storage_driver
                    extra["dockerd_start_s"] = round(time.perf_counter() - t0, 2)
                    cache = image_cache()
                else:
                    cache = REPO / ".rollstream" / "images"
                docker = DockerProvider(base_url=url, image_cache=cache)
                t1 = time.perf_counter()
                docker.ensure_image()
                extra["docker_image_ready_s"] = round(time.perf_counter() - t1, 2)
                results[kind] = bench_kind(docker, max(1, args.n * 2 // 3), args.execs)
                docker.close()
            else:
                provider = open_provider(kind, root=root / kind)
                results[kind] = bench_kind(provider, args.n, args.execs)
            r = results[kind]
            print(
                f"{kind:>10}: create+destroy "
                f"{r.get('create_destroy_ms', {}).get('p50', '-')} ms p50 "
                f"{r.get('create_destroy_ms', {}).get('p99', '-')} p99 | exec true "
                f"{r['exec_true_ms']['p50']} ms p50 {r['exec_true_ms']['p99']} p99 "
                f"({time.perf_counter() - t0:.1f} s)",
                file=sys.stderr,
            )
    finally:
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    summary = {
        "bench": "sandbox",
        "quick": args.quick,
        "load_avg_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "as_root": os.geteuid() == 0,
        **extra,
        **results,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
