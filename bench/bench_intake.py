"""Trainer intake vs. model step: is reading samples ever the trainer's bottleneck?

Intake is what the trainer's source does before a step: consume the samples topic from the real
broker (confluent-kafka, one consumer in a group), decode each record (Codec + validation),
batch by token budget and collate to tensors: ``SampleSource.fetch/decode`` +
``TokenBudgetBatcher`` + ``collate``, the trainer's own code path. Samples are 128-token path
samples (a 32-token prompt, 96 generated tokens), produced beforehand; timing starts at the
first record (the group join is not counted). The model side is one training step
(``trainer.train_step``: forward, PPO loss, backward, AdamW) of the tiny Qwen2 (hidden 128,
2 layers, vocab 512) on a batch of 16 x 128 tokens, median of several steps. The ratio
``intake_headroom = intake batches/s / model steps/s`` says how many trainers of that speed one
intake could feed: above 1, intake is never the bottleneck.

    .venv/bin/python bench/bench_intake.py [--quick] [--bootstrap HOST:PORT] [--samples N]

Starts its own Kafka broker in a temp dir unless --bootstrap is given. Prints one JSON object
on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from confluent_kafka import Producer
from transformers.utils import logging as hf_logging

from rollstream.adapters.topics import ensure_topics
from rollstream.consumers.training.batching import TokenBudgetBatcher, collate
from rollstream.consumers.training.dataset import SampleSource
from rollstream.consumers.training.ppo import LossConfig
from rollstream.consumers.training.step import train_step
from rollstream.inference.tinymodel import ensure_tiny_model, load_model
from rollstream.infra.kafka import BrokerConfig, KafkaBroker, free_port
from rollstream.schemas import Codec, CommonSettings, Sample

SEQ, PROMPT, BATCH = 128, 32, 16


def make_samples(count: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    mask = np.array([0] * PROMPT + [1] * (SEQ - PROMPT), dtype=np.uint8)
    return [
        Sample(
            sample_id=f"s{i}",
            rollout_id=f"r{i // 2}",
            group_id=f"g{i // 8}",
            task_id="t",
            input_ids=rng.integers(3, 500, SEQ, dtype=np.uint32),
            loss_mask=mask,
            behaviour_logprobs=(-rng.uniform(5.5, 7.0, SEQ) * mask).astype(np.float32),
            advantage=float(rng.normal()),
            reward=1.0,
            policy_version=0,
            loss_weight=0.5,
        )
        for i in range(count)
    ]


def produce(settings: CommonSettings, blobs: list[bytes]) -> float:
    """Produce the encoded samples round-robin over the samples topic; returns seconds."""
    producer = Producer(
        {**settings.kafka_config(), "acks": "all", "linger.ms": 5, "compression.type": "none"}
    )
    topic = settings.topics().samples
    started = time.perf_counter()
    for i, blob in enumerate(blobs):
        while True:
            try:
                producer.produce(topic, blob, key=f"g{i // 8}".encode())
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    assert producer.flush(60) == 0, "samples not delivered"
    return time.perf_counter() - started


def intake(settings: CommonSettings, count: int) -> dict[str, Any]:
    """Consume + decode + batch + collate ``count`` samples the way the trainer does."""
    source = SampleSource(settings, group_id=f"bench-intake-{uuid.uuid4().hex[:8]}")
    batcher = TokenBudgetBatcher(BATCH * SEQ)
    seen = tokens = batches = dlq = nbytes = 0
    started: float | None = None
    deadline = time.monotonic() + 120
    try:
        while seen < count and time.monotonic() < deadline:
            messages = source.fetch(1000, 0.2)
            if messages and started is None:
                started = time.perf_counter()
            for msg in messages:
                rec = source.decode(msg)
                nbytes += rec.nbytes
                if rec.sample is None:
                    dlq += 1
                    continue
                seen += 1
                tokens += len(rec.sample.input_ids)
                closed = batcher.add(rec.sample)
                if closed is not None:
                    collate(closed)
                    batches += 1
        last = batcher.flush()
        if last is not None:
            collate(last)
            batches += 1
        wall = time.perf_counter() - (started or time.perf_counter())
    finally:
        source.close()
    assert seen == count and dlq == 0, (seen, count, dlq)
    return {
        "intake_samples": seen,
        "intake_s": round(wall, 3),
        "intake_samples_per_s": round(seen / wall, 1),
        "intake_tokens_per_s": round(tokens / wall, 1),
        "intake_mb_per_s": round(nbytes / wall / 1e6, 2),
        "intake_batches_per_s": round(batches / wall, 2),
        "intake_ms_per_batch": round(1000 * wall / batches, 3),
    }


def model_step(steps: int, threads: int | None) -> dict[str, Any]:
    """Median time of ``trainer.train_step`` on 16 x 128 tokens with the tiny Qwen2."""
    if threads:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        model, _tok = load_model(ensure_tiny_model(Path(tmp) / "tiny"))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = collate(make_samples(BATCH, seed=1))
    times = []
    for i in range(steps + 1):
        t = time.perf_counter()
        train_step(model, optimizer, batch, LossConfig())
        if i >= 1:  # warm-up
            times.append(time.perf_counter() - t)
    params = sum(p.numel() for p in model.parameters())
    step_s = statistics.median(times)
    return {
        "model_params": params,
        "model_step_ms": round(1000 * step_s, 2),
        "model_steps_per_s": round(1 / step_s, 2),
        "model_tokens_per_s": round(BATCH * SEQ / step_s, 1),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, < 30 s")
    parser.add_argument("--bootstrap", help="use this broker instead of starting one")
    parser.add_argument("--samples", type=int, help="samples to read (default 50k, 2k quick)")
    parser.add_argument("--steps", type=int, help="model steps to time (default 20, 3 quick)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default all)")
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    count = args.samples or (2_000 if args.quick else 50_000)
    steps = args.steps or (3 if args.quick else 20)

    t0 = time.perf_counter()
    broker: KafkaBroker | None = None
    tmp = tempfile.TemporaryDirectory(prefix="bench-intake-")
    try:
        if args.bootstrap:
            bootstrap = args.bootstrap
        else:
            config = BrokerConfig(
                data_dir=Path(tmp.name) / "kafka", port=free_port(), controller_port=free_port()
            )
            broker = KafkaBroker(config).start(timeout=120)
            bootstrap = broker.bootstrap
        settings = CommonSettings(
            kafka_bootstrap=bootstrap, namespace=f"bench{uuid.uuid4().hex[:8]}"
        )
        ensure_topics(settings)
        codec = Codec()
        blobs = [codec.encode(s) for s in make_samples(count)]
        produce_s = produce(settings, blobs)
        figures = intake(settings, count)
    finally:
        if broker is not None:
            broker.kill()  # a throwaway data dir: no controlled shutdown needed
        tmp.cleanup()
    figures |= model_step(steps, args.threads)
    figures["intake_headroom"] = round(
        figures["intake_batches_per_s"] / figures["model_steps_per_s"], 2
    )
    figures["intake_share_of_step"] = round(
        figures["intake_ms_per_batch"] / figures["model_step_ms"], 4
    )
    result = {
        "bench": "intake",
        "quick": args.quick,
        "samples": count,
        "seq_len": SEQ,
        "batch": f"{BATCH}x{SEQ}",
        "record_bytes": len(blobs[0]),
        "produce_s": round(produce_s, 2),
        **figures,
        "broker": "external" if args.bootstrap else "local KRaft (started by the bench)",
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}",
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
