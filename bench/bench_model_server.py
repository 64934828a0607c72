"""Reference inference server throughput: tokens/s for one request at a time and for 16
concurrent requests, over HTTP against the server in its own process, plus the same two figures
for the sampling loop called in process (no HTTP), to show the serving overhead.

The tiny model (hidden 128, 2 layers, vocab 512: 427k parameters) is made in a temporary folder;
each request sends the token-id prompt of a short chat turn and asks for ``--max-tokens`` tokens
with ``ignore_eos`` so every request yields the same number. Prints one JSON object on the last
line.

    python bench/bench_model_server.py [--quick] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from rollstream.inference.tinymodel import (
    SamplingParams,
    generate,
    load_model,
    make_tiny_model,
    stop_token_ids,
)

CONCURRENCY = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: Path, port: int, threads: int) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "ROLLSTREAM_MODEL_PATH": str(model),
        "ROLLSTREAM_MODEL_PORT": str(port),
        "ROLLSTREAM_MODEL_CREATE": "false",
        "ROLLSTREAM_MODEL_TORCH_THREADS": str(threads),
    }
    cmd = [sys.executable, "-m", "rollstream.infra.cli", "serve-model"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not become healthy in 120 s")


async def http_figures(
    url: str, prompt: list[int], max_tokens: int, n_seq: int, rounds: int
) -> dict[str, Any]:
    def body(seed: int) -> dict[str, Any]:
        return {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "seed": seed,
            "ignore_eos": True,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }

    async with httpx.AsyncClient(base_url=url, timeout=300) as http:

        async def one(seed: int) -> tuple[int, float]:
            t = time.perf_counter()
            r = await http.post("/v1/completions", json=body(seed))
            r.raise_for_status()
            return len(r.json()["choices"][0]["token_ids"]), time.perf_counter() - t

        for s in range(2):  # warm-up
            await one(s)
        t = time.perf_counter()
        seq = [await one(100 + i) for i in range(n_seq)]
        seq_wall = time.perf_counter() - t
        t = time.perf_counter()
        conc: list[tuple[int, float]] = []
        for r in range(rounds):
            conc += await asyncio.gather(*(one(1000 + r * 100 + i) for i in range(CONCURRENCY)))
        conc_wall = time.perf_counter() - t
    return {
        "http_unbatched_tok_s": round(sum(n for n, _ in seq) / seq_wall, 1),
        "http_concurrent16_tok_s": round(sum(n for n, _ in conc) / conc_wall, 1),
        "http_unbatched_p50_ms": round(1000 * statistics.median(d for _, d in seq), 1),
        "http_concurrent16_p50_ms": round(1000 * statistics.median(d for _, d in conc), 1),
    }


def engine_figures(
    model_dir: Path, prompt: list[int], max_tokens: int, n_seq: int, rounds: int, threads: int
) -> dict[str, Any]:
    torch.set_num_threads(threads)
    model, tok = load_model(model_dir)
    kw = {"eos_token_ids": stop_token_ids(tok), "pad_token_id": tok.pad_token_id}

    def sp(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True)

    generate(model, [prompt], [sp(0)], **kw)  # warm-up
    t = time.perf_counter()
    n = sum(len(generate(model, [prompt], [sp(i)], **kw)[0].token_ids) for i in range(n_seq))
    one = n / (time.perf_counter() - t)
    t, n = time.perf_counter(), 0
    for r in range(rounds):
        outs = generate(
            model, [prompt] * CONCURRENCY, [sp(r * 100 + i) for i in range(CONCURRENCY)], **kw
        )
        n += sum(len(o.token_ids) for o in outs)
    batch = n / (time.perf_counter() - t)
    return {"engine_unbatched_tok_s": round(one, 1), "engine_batch16_tok_s": round(batch, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer requests (< 30 s)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    n_seq, rounds = (8, 2) if args.quick else (32, 8)

    with tempfile.TemporaryDirectory(prefix="bench-model-") as tmp:
        model_dir = make_tiny_model(
            Path(tmp) / "tiny", seed=0, hidden=args.hidden, layers=args.layers
        )
        model, tok = load_model(model_dir)
        params = sum(p.numel() for p in model.parameters())
        del model
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "List the Python files in the src directory."}],
            add_generation_prompt=True,
            return_dict=False,
        )
        port = free_port()
        proc = start_server(model_dir, port, args.threads)
        try:
            figures = asyncio.run(
                http_figures(f"http://127.0.0.1:{port}", prompt, args.max_tokens, n_seq, rounds)
            )
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        figures |= engine_figures(model_dir, prompt, args.max_tokens, n_seq, rounds, args.threads)

    result = {
        "bench": "model_server",
        "quick": args.quick,
        "params": params,
        "hidden": args.hidden,
        "layers": args.layers,
        "vocab": len(tok),
        "prompt_tokens": len(prompt),
        "max_tokens": args.max_tokens,
        "torch_threads": args.threads,
        "sequential_requests": n_seq,
        "concurrent_requests": rounds * CONCURRENCY,
        **figures,
    }
    for k, v in figures.items():
        print(f"{k:>28}: {v}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
