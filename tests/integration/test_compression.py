"""Compressed events on the real broker: rollouts recorded with each of the SDK's compression
codecs (``RecorderSettings.compression``) are read by the stream processor (faust over aiokafka,
which needs cramjam for lz4/snappy/zstd) and by the ClickHouse sink (confluent-kafka)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from _kafka_read import read_topic
from _processor_process import Worker, reading, sample_ids
from _sink_process import SinkProcess

from rollstream.producers.sdk.recorder import Recorder, RecorderSettings
from rollstream.schemas import Codec, CommonSettings, Event, Sample

pytestmark = pytest.mark.integration

codec = Codec()
CODECS = ("zstd", "lz4", "snappy", "gzip")


def record(settings: CommonSettings, tmp_path: Path, compression: str) -> None:
    """One group of 4 rollouts (rewards 0..3, so the group has samples), two calls each."""
    rng = np.random.default_rng(len(compression))
    rec = Recorder(
        RecorderSettings(
            kafka_bootstrap=settings.kafka_bootstrap,
            namespace=settings.namespace,
            spool_dir=tmp_path / f"spool-{compression}",
            compression=compression,
        )
    )
    try:
        for i in range(4):
            with rec.rollout(task_id="t", group_id=f"g-{compression}", group_size=4) as r:
                prompt = rng.integers(0, 1000, 300).astype(np.uint32)
                c1 = r.llm_call(prompt, np.full(40, 7, np.uint32), np.full(40, -0.5, np.float32))
                r.tool_call("bash", {"cmd": "ls"}, "ok " * 50, at_call_id=c1)
                prompt2 = np.concatenate([prompt, np.full(41, 7, np.uint32)])
                r.llm_call(prompt2, np.full(40, 9, np.uint32), np.full(40, -0.25, np.float32))
                r.reward(float(i))
        assert rec.flush(60)
    finally:
        stats = rec.close()
    assert stats.sent == 4 * 6 and stats.failed == 0, stats


def test_every_sdk_compression_codec_is_read_by_the_processor_and_the_sink(
    kafka_settings: CommonSettings, tmp_path: Path
) -> None:
    topics = kafka_settings.topics()
    worker = Worker(kafka_settings, tmp_path, group_timeout_s="300")  # groups close full
    sink = SinkProcess(kafka_settings, tmp_path, sink_flush_interval_s="0.2")
    try:
        worker.start()
        sink.start()
        with reading(kafka_settings, topics.samples) as samples:
            for name in CODECS:
                record(kafka_settings, tmp_path, name)
            # 4 groups of 4 rollouts with distinct rewards: one path sample per rollout
            samples.wait(lambda rs: len(rs) >= 4 * len(CODECS), 90, worker)
            time.sleep(0.5)
            got = [codec.decode(m.value(), expect=Sample) for m in samples.records]
        assert len(sample_ids(samples.records)) == len(got) == 4 * len(CODECS)
        assert {s.group_id for s in got} == {f"g-{name}" for name in CODECS}

        produced = {
            codec.decode(m.value(), expect=Event).event_id
            for m in read_topic(kafka_settings, topics.events)
        }
        assert len(produced) == 4 * 6 * len(CODECS)
        sink.wait_ready()
        with sink.client() as api:
            deadline = time.monotonic() + 60
            while True:
                stored = set(api.query("SELECT event_id FROM events").column("event_id"))
                if stored >= produced or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        assert stored == produced, sink.log_tail()
        assert "UnsupportedCodec" not in worker.log_tail(400)
        assert read_topic(kafka_settings, topics.dlq) == []
    finally:
        worker.stop()
        sink.stop()
