"""The sink after a crash that poisoned a dedup token (consumers/store/verify.py).

A process killed inside a ClickHouse insert can leave the insert's token in the table's
deduplication log without its rows; a retry with that token is then silently dropped. This
test builds that state on purpose — a decoy block inserted with the token the sink's first
batch of each partition will use, then deleted — and checks the sink still stores every event:
it verifies re-read batches against the table instead of trusting their tokens."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from _kafka_read import read_topic
from _sink_process import (
    Committed,
    SinkProcess,
    ends_of,
    record_rollouts,
    wait_committed,
)

from rollstream.consumers.store import chstore
from rollstream.schemas import Codec, CommonSettings, Event

pytestmark = pytest.mark.integration

codec = Codec()

POISON = textwrap.dedent(
    """
    import sys
    from rollstream.consumers.store import chstore
    from rollstream.consumers.store.migrations import apply_migrations

    url, db, day, tokens = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    client = chstore.connect(url)
    apply_migrations(client, db)
    for token in tokens:  # a block in the batch's day partition, under the batch's token
        client.command(
            f"INSERT INTO {db}.events (event_id, rollout_id, ts, kafka_topic) "
            f"SETTINGS insert_deduplication_token = '{token}' "
            f"VALUES ('decoy', 'decoy', '{day} 12:00:00', 'decoy')"
        )
    client.command(
        f"ALTER TABLE {db}.events DELETE WHERE event_id = 'decoy' SETTINGS mutations_sync = 2"
    )
    left = client.command(f"SELECT count() FROM {db}.events")
    assert int(left) == 0, left
    """
)


def test_a_poisoned_dedup_token_does_not_lose_the_batch(
    kafka_settings: CommonSettings, tmp_path: Path
) -> None:
    topics = kafka_settings.topics()
    record_rollouts(kafka_settings, tmp_path, 12)
    messages = read_topic(kafka_settings, topics.events)
    produced = {codec.decode(m.value(), expect=Event).event_id for m in messages}
    days = {
        datetime.fromtimestamp(codec.decode(m.value(), expect=Event).ts / 1e6, UTC).date()
        for m in messages
    }
    assert len(produced) == 96 and len(days) == 1  # one day partition (not across midnight)
    ends = ends_of(kafka_settings, [topics.events])
    # the sink's first batch of each partition: every message it has (batches of 1000, cut by
    # the flush timer once caught up), token topic:partition:first:last, per table ":events"
    tokens = [f"{t}:{p}:0:{end - 1}:events" for (t, p), end in ends.items() if end]
    assert len(tokens) > 1
    sink = SinkProcess(kafka_settings, tmp_path, sink_batch_messages="1000",
                       sink_flush_interval_s="0.2")  # fmt: skip
    database = chstore.database_for(kafka_settings.namespace)
    subprocess.run(
        [sys.executable, "-c", POISON, f"chdb://{sink.chdb_path}", database,
         str(days.pop()), *tokens],
        check=True, timeout=120,
    )  # fmt: skip
    committed = Committed(kafka_settings)
    try:
        sink.start()
        sink.wait_ready()
        wait_committed(committed, ends, sink, 60)
        with sink.client() as api:
            stored: Any = api.query("SELECT event_id FROM events").column("event_id")
            typed = api.query("SELECT count() FROM llm_calls").rows[0][0]
    finally:
        committed.close()
        sink.stop()
    assert len(stored) == len(set(stored))  # no duplicate either
    assert set(stored) == produced, sink.log_tail()
    assert typed == 24  # tables whose tokens were not poisoned are stored once too


def test_a_verified_batch_killed_before_its_commit_is_stored_once(
    kafka_settings: CommonSettings, tmp_path: Path
) -> None:
    """The first batch of a partition after an assignment is verified and inserted, and the sink
    is killed before it commits; the next run reads the same batch, verifies it again and finds
    it stored. Nothing may be stored twice: a first version of the verification inserted a batch
    of which nothing was stored under a fresh token, which the next run's re-send under the
    batch's own token did not match (whole batches twice in llm_calls in the 100-kill loop)."""
    topics = kafka_settings.topics()
    record_rollouts(kafka_settings, tmp_path, 12)
    ends = ends_of(kafka_settings, [topics.events])
    sink = SinkProcess(kafka_settings, tmp_path, sink_batch_messages="1000",
                       sink_flush_interval_s="0.2", sink_debug_commit_delay_s="120")  # fmt: skip
    committed = Committed(kafka_settings)
    try:
        sink.start()
        sink.wait_ready()
        deadline = time.monotonic() + 60
        while " inserted " not in sink.current_log():  # the first batch is in, its commit waits
            assert time.monotonic() < deadline, sink.log_tail()
            time.sleep(0.05)
        assert "verified " in sink.current_log()
        sink.kill()
        del sink.env["ROLLSTREAM_SINK_DEBUG_COMMIT_DELAY_S"]
        sink.start()
        sink.wait_ready()
        wait_committed(committed, ends, sink, 60)
        with sink.client() as api:
            events = api.query("SELECT count(), uniqExact(event_id) FROM events").rows[0]
            calls = api.query("SELECT count(), uniqExact(event_id) FROM llm_calls").rows[0]
    finally:
        committed.close()
        sink.stop()
    assert sink.killed_mid_batch() == 1
    # the second run verified the batch again and found its rows there
    assert re.search(r"verified \S+: [1-9]\d* rows stored already", sink.current_log())
    assert list(events) == [96, 96], sink.log_tail()  # raw rows: no batch stored twice
    assert list(calls) == [24, 24], sink.log_tail()
