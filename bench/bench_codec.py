"""Codec: token arrays as packed bytes (numpy.frombuffer) vs Avro arrays (array<int>/<float>).

Encodes and decodes LlmCall events with a 2,000-token prompt delta and a 200-token completion,
both ways, in one process on one core, alternating rounds; reports medians, token IDs/s and the
ratio. Prints one JSON object on the last line.

    python bench/bench_codec.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import statistics
import time
from typing import Any

import fastavro
import numpy as np

from rollstream.schemas import Codec, Event, LlmCall, load_schema

PROMPT, COMPLETION = 2000, 200


def array_schema() -> dict[str, Any]:
    """The same envelope with token fields as Avro arrays instead of packed bytes."""
    schema = copy.deepcopy(load_schema("rollstream.Event"))
    body = next(f for f in schema["fields"] if f["name"] == "body")
    llm = next(t for t in body["type"] if isinstance(t, dict) and t["name"] == "LlmCall")
    for f in llm["fields"]:
        if f["name"] in ("prompt_delta", "completion_ids"):
            f["type"] = {"type": "array", "items": "long"}
        elif f["name"] == "completion_logprobs":
            f["type"] = {"type": "array", "items": "float"}
    return schema


def make_event(rng: np.random.Generator, i: int) -> Event:
    return Event(
        event_id=f"{i:026d}",
        rollout_id=f"r{i % 100}",
        seq=i,
        ts=i,
        body=LlmCall(
            call_id=f"c{i}",
            parent_call_id=f"c{i - 1}",
            prefix_len=4000,
            prompt_delta=rng.integers(0, 150_000, PROMPT, dtype=np.uint32),
            completion_ids=rng.integers(0, 150_000, COMPLETION, dtype=np.uint32),
            completion_logprobs=-rng.random(COMPLETION, dtype=np.float32),
        ),
    )


def bench_packed(codec: Codec, blobs: list[bytes]) -> float:
    t = time.perf_counter()
    n = 0
    for b in blobs:
        ev = codec.decode(b)
        n += int(ev.body.prompt_delta.sum() > 0) + len(ev.body.completion_ids)
    return time.perf_counter() - t


def bench_arrays(parsed: Any, blobs: list[bytes]) -> float:
    t = time.perf_counter()
    for b in blobs:
        rec = fastavro.schemaless_reader(io.BytesIO(b), parsed, None, return_record_name=True)
        body = rec["body"][1]
        # the consumer needs arrays, as the packed path gives: convert
        np.asarray(body["prompt_delta"], dtype=np.uint32)
        np.asarray(body["completion_ids"], dtype=np.uint32)
        np.asarray(body["completion_logprobs"], dtype=np.float32)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n_events, rounds = (300, 5) if args.quick else (2000, 9)
    rng = np.random.default_rng(0)
    events = [make_event(rng, i) for i in range(n_events)]
    codec = Codec()
    parsed = fastavro.parse_schema(array_schema())

    t = time.perf_counter()
    packed = [codec.encode(ev) for ev in events]
    enc_packed = time.perf_counter() - t
    t = time.perf_counter()
    arrays = []
    for ev in events:
        d = ev.to_avro()
        name, body = d["body"]
        body = {
            **body,
            "prompt_delta": ev.body.prompt_delta.tolist(),
            "completion_ids": ev.body.completion_ids.tolist(),
            "completion_logprobs": ev.body.completion_logprobs.tolist(),
        }
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, parsed, {**d, "body": (name, body)})
        arrays.append(buf.getvalue())
    enc_arrays = time.perf_counter() - t

    packed_t, arrays_t = [], []
    for _ in range(rounds):
        packed_t.append(bench_packed(codec, packed))
        arrays_t.append(bench_arrays(parsed, arrays))
    tokens = n_events * (PROMPT + COMPLETION)
    p, a = statistics.median(packed_t), statistics.median(arrays_t)
    result = {
        "bench": "codec",
        "events": n_events,
        "tokens_per_event": PROMPT + COMPLETION,
        "rounds": rounds,
        "packed_decode_tokens_per_s": round(tokens / p),
        "arrays_decode_tokens_per_s": round(tokens / a),
        "decode_speedup_packed_vs_arrays": round(a / p, 1),
        "packed_encode_tokens_per_s": round(tokens / enc_packed),
        "arrays_encode_tokens_per_s": round(tokens / enc_arrays),
        "packed_bytes_per_event": round(sum(map(len, packed)) / n_events),
        "arrays_bytes_per_event": round(sum(map(len, arrays)) / n_events),
    }
    print(
        f"packed: {result['packed_decode_tokens_per_s'] / 1e6:.1f}M token IDs/s decoded; "
        f"avro arrays: {result['arrays_decode_tokens_per_s'] / 1e6:.1f}M/s "
        f"({result['decode_speedup_packed_vs_arrays']}x)"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
