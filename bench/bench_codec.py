"""Codec: token arrays as packed bytes (numpy.frombuffer) vs Avro arrays (array<int>/<float>),
and the compiled reader (schemas/fastread.py) vs fastavro + ``from_avro``.

1. Encodes and decodes LlmCall events with a 2,000-token prompt delta and a 200-token
   completion, both ways, in one process on one core, alternating rounds; reports medians,
   token IDs/s and the ratio.
2. Decodes the events of agent rollouts (RolloutStarted, then per turn an LlmCall with a
   200-token delta and a 100-token completion, a ToolCall and a milestone Reward, then
   RolloutFinished) with ``Codec.decode`` (the compiled reader) and with the path it replaced
   (fastavro's dict, then ``Event.from_avro``), alternating rounds, CPU time; reports medians
   in events/s and the ratio; also for Trajectory and Sample records.

Prints one JSON object on the last line.

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

from rollstream.schemas import (
    RECORD_TYPES,
    Codec,
    Event,
    LlmCall,
    Reward,
    RolloutFinished,
    RolloutStarted,
    Sample,
    ToolCall,
    Trajectory,
    TrajectoryNode,
    load_schema,
)

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


def rollout_events(rng: np.random.Generator, rollouts: int, turns: int = 20) -> list[Event]:
    """The events of ``rollouts`` agent rollouts (see the module docstring)."""
    out: list[Event] = []
    for r in range(rollouts):
        rid = f"01JD{r:022d}"
        bodies: list[Any] = [RolloutStarted("task-7", "group-3", group_size=8, harness="bench")]
        for t in range(turns):
            bodies.append(
                LlmCall(
                    f"c{t}",
                    f"c{t - 1}" if t else None,
                    300 * t,
                    rng.integers(0, 150_000, 200, dtype=np.uint32),
                    rng.integers(0, 150_000, 100, dtype=np.uint32),
                    -rng.random(100, dtype=np.float32),
                    model="qwen",
                    backend="http://127.0.0.1:8001",
                    latency_ms=812.5,
                )
            )
            bodies.append(ToolCall(f"t{t}", "bash", '{"cmd": "ls"}', "ok", at_call_id=f"c{t}"))
            bodies.append(Reward(0.1, "milestone", name=f"turn{t}", at_call_id=f"c{t}"))
        bodies.append(RolloutFinished("completed"))
        out += [
            Event(f"{rid}{i:04d}", rid, i, 1_700_000_000_000_000 + i, b, "sdk")
            for i, b in enumerate(bodies)
        ]
    return out


def derived_records(rng: np.random.Generator, n: int) -> list[Any]:
    """Trajectories of 20 nodes and 3,000-token path samples, alternating."""
    out: list[Any] = []
    for i in range(n):
        nodes = [
            TrajectoryNode(
                f"c{t}",
                f"c{t - 1}" if t else None,
                300 * t,
                rng.integers(0, 150_000, 200, dtype=np.uint32),
                rng.integers(0, 150_000, 100, dtype=np.uint32),
                -rng.random(100, dtype=np.float32),
            )
            for t in range(20)
        ]
        out.append(Trajectory(f"r{i}", "task", "group", "completed", 1.0, nodes))
        tokens = 3000
        out.append(
            Sample(
                f"s{i}",
                f"r{i}",
                "group",
                "task",
                rng.integers(0, 150_000, tokens, dtype=np.uint32),
                (rng.random(tokens) < 0.3).astype(np.uint8),
                -rng.random(tokens, dtype=np.float32),
                0.5,
                1.0,
                3,
                token_policy_versions=np.full(tokens, 3, np.int64),
                policy_versions=[3],
                num_tokens=tokens,
            )
        )
    return out


def compare_readers(codec: Codec, blobs: list[bytes], rounds: int) -> dict[str, Any]:
    """Codec.decode (compiled reader) vs fastavro + from_avro, alternating rounds, CPU time."""

    def compiled() -> float:
        t = time.process_time()
        for b in blobs:
            codec.decode(b)
        return time.process_time() - t

    def fastavro_path() -> float:
        t = time.process_time()
        for b in blobs:
            name, record = codec.decode_dict(b)
            RECORD_TYPES[name].from_avro(record)
        return time.process_time() - t

    for b in blobs:  # the same records both ways
        name, record = codec.decode_dict(b)
        assert codec.decode(b) == RECORD_TYPES[name].from_avro(record)
    fast_t, slow_t = [], []
    for _ in range(rounds):
        fast_t.append(compiled())
        slow_t.append(fastavro_path())
    f, s = statistics.median(fast_t), statistics.median(slow_t)
    return {
        "records": len(blobs),
        "compiled_records_per_s": round(len(blobs) / f),
        "fastavro_records_per_s": round(len(blobs) / s),
        "speedup": round(s / f, 2),
    }


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
    rollouts = 10 if args.quick else 50
    result["rollout_events"] = compare_readers(
        codec, [codec.encode(e) for e in rollout_events(rng, rollouts)], rounds
    )
    result["derived_records"] = compare_readers(
        codec, [codec.encode(r) for r in derived_records(rng, rollouts * 4)], rounds
    )
    for what in ("rollout_events", "derived_records"):
        r = result[what]
        print(
            f"{what}: compiled reader {r['compiled_records_per_s']:,} records/s, "
            f"fastavro + from_avro {r['fastavro_records_per_s']:,}/s ({r['speedup']}x)"
        )
    print(
        f"packed: {result['packed_decode_tokens_per_s'] / 1e6:.1f}M token IDs/s decoded; "
        f"avro arrays: {result['arrays_decode_tokens_per_s'] / 1e6:.1f}M/s "
        f"({result['decode_speedup_packed_vs_arrays']}x)"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
