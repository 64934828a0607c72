"""The harness SDK against the in-memory transport: events, deltas, failures, outages, spool."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ulid import ULID

from rollstream.producers import (
    ContextTrie,
    DeliveryError,
    MemoryTransport,
    Recorder,
    RecorderSettings,
    RecorderUsageError,
    Spool,
)
from rollstream.schemas import (
    Codec,
    EvaluatorOutput,
    Event,
    LlmCall,
    RolloutFinished,
    RolloutStarted,
    SandboxEvent,
    StageEvent,
    Topics,
    Usage,
)

NS = "unit"
TOPIC = Topics(NS).events
codec = Codec()


def make_settings(tmp_path: Path, **kw: object) -> RecorderSettings:
    base: dict[str, object] = {
        "namespace": NS,
        "spool_dir": tmp_path / "spool",
        "degrade_after_s": 0.2,
        "probe_interval_s": 0.05,
        "close_timeout_s": 5.0,
        "producer": "unit-test",
    }
    base.update(kw)
    return RecorderSettings(**base)


def consumed(transport: MemoryTransport) -> list[Event]:
    return [codec.decode(m.value) for m in transport.messages(TOPIC)]


def assert_exactly_once_in_order(events: list[Event], expected: int | None = None) -> None:
    ids = [e.event_id for e in events]
    assert len(ids) == len(set(ids)), "duplicate events"
    if expected is not None:
        assert len(events) == expected
    seqs: dict[str, list[int]] = defaultdict(list)
    for e in events:  # messages() is partition by partition, offset order: per-key order
        seqs[e.rollout_id].append(e.seq)
    for rollout_id, got in seqs.items():
        assert got == list(range(len(got))), f"{rollout_id}: {got[:20]}"


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def record_rollouts(recorder: Recorder, n: int, events_each: int, tag: str = "") -> None:
    for i in range(n):
        with recorder.rollout(task_id=f"task{tag}{i}", group_id="g") as r:
            for j in range(events_each - 2):
                r.reward(float(j), "partial")


# --- events ------------------------------------------------------------------------------------


def test_rollout_envelope_and_lifecycle(tmp_path: Path) -> None:
    transport = MemoryTransport()
    with Recorder(make_settings(tmp_path), transport=transport) as recorder:
        with recorder.rollout(
            task_id="t1", group_id="g1", attempt=2, sampling={"temperature": 1}, metadata={"a": 1}
        ) as r:
            r.tool_call("search", arguments={"q": "x"}, result="ok")
            r.reward(1.0)
        assert r.finished and r.seq == 4
        assert recorder.flush(5)
    msgs = transport.messages(TOPIC)
    events = [codec.decode(m.value) for m in msgs]
    assert {m.key for m in msgs} == {r.rollout_id.encode()}
    assert [e.seq for e in events] == [0, 1, 2, 3]
    assert [e.kind for e in events] == ["RolloutStarted", "ToolCall", "Reward", "RolloutFinished"]
    started = events[0].body
    assert isinstance(started, RolloutStarted)
    assert (started.task_id, started.group_id, started.attempt) == ("t1", "g1", 2)
    assert started.sampling == {"temperature": 1.0} and started.metadata == {"a": "1"}
    assert events[1].body.arguments == '{"q": "x"}'
    assert all(e.producer == "unit-test" and e.rollout_id == r.rollout_id for e in events)
    for e in events:  # valid ULIDs that carry the event's time
        assert abs(ULID.from_str(e.event_id).milliseconds - e.ts // 1000) < 1000
    assert events[-1].body == RolloutFinished("completed", None)
    assert recorder.stats.sent == 4 and recorder.stats.state == "closed"


def test_llm_calls_carry_deltas_that_rebuild_the_prompts(tmp_path: Path) -> None:
    transport = MemoryTransport()
    rng = np.random.default_rng(3)
    prompts, completions, ids = [], [], []

    def tokens(n: int) -> np.ndarray:
        return rng.integers(0, 1000, n, dtype=np.uint32)

    recorder = Recorder(make_settings(tmp_path), transport=transport)
    with recorder, recorder.rollout(task_id="t", group_id="g") as r:
        convo = tokens(500)
        for turn in range(6):
            if turn == 4:  # the harness edits its context: a rewind
                convo = np.concatenate((convo[:300], tokens(7)))
            completion = tokens(20)
            lps = -rng.random(20, dtype=np.float32)
            ids.append(r.llm_call(convo, completion, lps, model="m", latency_ms=3))
            prompts.append(convo)
            completions.append(completion)
            convo = np.concatenate((convo, completion, tokens(5)))
        given = r.llm_call(convo, [1], [-0.5], call_id="mine")
    assert given == "mine"
    calls = [e.body for e in consumed(transport) if isinstance(e.body, LlmCall)]
    assert [c.call_id for c in calls[:6]] == ids
    assert len(calls[1].prompt_delta) == 5  # only the new tokens travel
    assert calls[4].prefix_len == 300 and calls[4].parent_call_id == ids[3]
    assert calls[0].usage.prompt_tokens == 500 and calls[0].usage.completion_tokens == 20
    rebuilt = ContextTrie()
    for c, prompt, completion in zip(calls, prompts, completions, strict=False):
        full = rebuilt.add_delta(
            c.call_id, c.parent_call_id, c.prefix_len, c.prompt_delta, c.completion_ids
        )
        assert np.array_equal(full, prompt)
        assert np.array_equal(c.completion_ids, completion)


def test_exception_finishes_failed_and_propagates(tmp_path: Path) -> None:
    transport = MemoryTransport()
    with Recorder(make_settings(tmp_path), transport=transport) as recorder:
        with pytest.raises(RuntimeError, match="boom"), recorder.rollout(task_id="t", group_id="g"):
            raise RuntimeError("boom")
        with pytest.raises(KeyboardInterrupt), recorder.rollout(task_id="t2", group_id="g"):
            raise KeyboardInterrupt
    finished = [e.body for e in consumed(transport) if isinstance(e.body, RolloutFinished)]
    assert {(f.status, f.error) for f in finished} == {
        ("failed", "RuntimeError('boom')"),
        ("aborted", "KeyboardInterrupt()"),
    }


def test_misuse_raises_at_the_call_site(tmp_path: Path) -> None:
    with Recorder(make_settings(tmp_path), transport=MemoryTransport()) as recorder:
        r = recorder.rollout(task_id="t", group_id="g")
        with pytest.raises(RecorderUsageError):
            r.llm_call([1, 2], [3, 4], [-0.1])
        with pytest.raises(RecorderUsageError, match="RewardKind"):
            r.reward(1.0, "bonus")
        with pytest.raises(RecorderUsageError, match="cannot encode"):
            r.tool_call("x", sandbox=123)
        assert r.seq == 1  # nothing was emitted: seq stays gap-free
        assert r.finish("timeout") is True
        assert r.finish() is False
        with pytest.raises(RecorderUsageError):
            r.reward(1.0)


def test_lifecycle_facts_are_recorded_in_order_and_only_those(tmp_path: Path) -> None:
    transport = MemoryTransport()
    with Recorder(make_settings(tmp_path), transport=transport) as recorder:
        r = recorder.rollout(task_id="t", group_id="g")
        facts = [
            StageEvent("init", "started", job_id="j"),
            SandboxEvent("sb", "ready", "bwrap", 5.0, "j"),
            EvaluatorOutput("suite", "ok", 1, 2, "out"),
        ]
        ids = r.lifecycle(facts)
        with pytest.raises(RecorderUsageError, match="not a lifecycle body"):
            r.lifecycle([StageEvent("run"), RolloutFinished()])  # type: ignore[list-item]
        assert r.seq == 4  # the refused list emitted nothing
        r.finish()
        with pytest.raises(RecorderUsageError, match="lifecycle after"):
            r.lifecycle(facts[:1])
    events = consumed(transport)
    assert [e.body for e in events[1:4]] == facts and [e.event_id for e in events[1:4]] == ids
    assert [e.seq for e in events] == [0, 1, 2, 3, 4]


def test_tool_result_is_bounded(tmp_path: Path) -> None:
    transport = MemoryTransport()
    rec = Recorder(make_settings(tmp_path, max_tool_result_chars=10), transport=transport)
    with rec, rec.rollout(task_id="t", group_id="g") as r:
        r.tool_call("cat", "f", "x" * 100, is_error=True)
    tool = consumed(transport)[1].body
    assert tool.result == "x" * 10 and tool.result_truncated and tool.is_error


def test_concurrent_rollouts_from_threads(tmp_path: Path) -> None:
    transport = MemoryTransport()
    with Recorder(make_settings(tmp_path, queue_size=100), transport=transport) as recorder:
        threads = [
            threading.Thread(target=record_rollouts, args=(recorder, 10, 12, str(t)))
            for t in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert recorder.flush(10)
    assert_exactly_once_in_order(consumed(transport), 8 * 10 * 12)


# --- failures and outages ----------------------------------------------------------------------


def test_outage_spools_then_drains_in_order(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rollstream.producers")
    transport = MemoryTransport()
    recorder = Recorder(make_settings(tmp_path), transport=transport)
    record_rollouts(recorder, 3, 10, "a")
    assert recorder.flush(5)
    transport.available = False
    r = recorder.rollout(task_id="long", group_id="g")  # spans the outage
    record_rollouts(recorder, 3, 10, "b")
    wait_for(lambda: recorder.stats.state == "degraded")
    for j in range(30):
        r.reward(float(j), "partial")
    record_rollouts(recorder, 3, 10, "c")
    assert recorder.stats.spooled > 0
    assert not recorder.flush(0.2)  # bounded: returns while Kafka is down
    transport.available = True
    r.finish()
    assert recorder.flush(10)
    stats = recorder.close()
    assert_exactly_once_in_order(consumed(transport), 9 * 10 + 32)
    assert stats.dropped == 0 and stats.failed == 0 and stats.spool_backlog == 0
    text = caplog.text
    assert "Kafka unreachable" in text and "spooling events" in text
    assert "Kafka reachable again" in text


def test_failed_deliveries_are_resent_in_order_exactly_once(tmp_path: Path) -> None:
    transport = MemoryTransport()
    recorder = Recorder(make_settings(tmp_path), transport=transport)
    transport.fail_next(3)
    record_rollouts(recorder, 6, 20)
    assert recorder.flush(10)
    stats = recorder.close()
    assert_exactly_once_in_order(consumed(transport), 120)
    assert stats.spooled > 0 and stats.sent == 120


def test_permanent_rejection_is_counted_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    transport = MemoryTransport()
    recorder = Recorder(make_settings(tmp_path), transport=transport)
    transport.fail_next(1, DeliveryError("MSG_SIZE_TOO_LARGE", "too big", permanent=True))
    record_rollouts(recorder, 1, 5)
    assert recorder.flush(5)
    stats = recorder.close()
    assert (stats.failed, stats.sent) == (1, 4)
    assert "rejected an event for good" in caplog.text


def test_queue_overflow_spools_and_keeps_order(tmp_path: Path) -> None:
    transport = MemoryTransport(capacity=5)  # the client's buffer fills at once
    recorder = Recorder(make_settings(tmp_path, queue_size=5), transport=transport)
    threads = [
        threading.Thread(target=record_rollouts, args=(recorder, 5, 30, str(t))) for t in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert recorder.flush(20)
    stats = recorder.close()
    assert stats.spooled > 0
    assert_exactly_once_in_order(consumed(transport), 4 * 5 * 30)


def test_submit_hands_over_in_the_callers_thread_then_queues_behind_a_full_client(
    tmp_path: Path,
) -> None:
    """While nothing waits, ``submit`` hands the event to the client itself (no queue hop, no
    wake-up of the thread); while the client's buffer is full, events queue and the thread
    hands them over in order, later events staying behind them; a failed delivery stops the
    direct hand-over until it is settled (spooled, re-sent): nothing overtakes it."""

    class Gated(MemoryTransport):
        def __init__(self) -> None:
            super().__init__()
            self.full = False
            self.callers: set[int] = set()

        def produce(self, *args: Any, **kwargs: Any) -> None:
            if self.full:
                raise BufferError("full")
            self.callers.add(threading.get_ident())
            super().produce(*args, **kwargs)

    transport = Gated()
    recorder = Recorder(make_settings(tmp_path), transport=transport)
    r = recorder.rollout(task_id="t", group_id="g")
    r.reward(1.0, "partial")
    assert transport.callers == {threading.get_ident()} and recorder.stats.queued == 0
    transport.full = True
    for i in range(20):
        r.reward(float(i), "partial")
    assert recorder.stats.queued == 20  # the thread keeps trying; nothing got past the gate
    transport.full = False
    for i in range(20):
        r.reward(float(i), "partial")
    r.finish()
    assert recorder.flush(10)
    assert recorder.delivery._thread.ident in transport.callers  # the queue went via the thread
    transport.fail_next(1)  # a delivery fails: the events after it must not overtake it
    record_rollouts(recorder, 2, 20, "x")
    assert recorder.flush(10)
    stats = recorder.close()
    assert stats.sent == 43 + 40 and stats.spooled >= 1
    assert_exactly_once_in_order(consumed(transport), 43 + 40)


def test_a_handed_over_event_wakes_no_thread_and_its_report_still_comes(tmp_path: Path) -> None:
    """An event ``submit`` hands to the client itself does not wake the sleeping delivery thread
    (a wake per event costs the harness's thread a context switch): its delivery report is
    polled at the thread's next look, within its 50 ms sleep, with no flush. An event queued
    behind a full client does wake it."""

    class Counting(threading.Event):
        sets = 0

        def set(self) -> None:
            Counting.sets += 1
            super().set()

    class Gated(MemoryTransport):
        full = False

        def produce(self, *args: Any, **kwargs: Any) -> None:
            if self.full:
                raise BufferError("full")
            super().produce(*args, **kwargs)

    transport = Gated()
    recorder = Recorder(make_settings(tmp_path), transport=transport)
    delivery = recorder.delivery
    delivery._wake = Counting()
    wait_for(lambda: delivery._asleep)  # no events for _NAP_FOR_S: it sleeps until woken
    r = recorder.rollout(task_id="t", group_id="g")
    r.reward(1.0, "partial")
    assert Counting.sets == 0 and recorder.stats.queued == 0
    wait_for(lambda: delivery.idle(), timeout=1.0)  # the reports came, nothing was flushed
    assert recorder.stats.sent == 2 and Counting.sets == 0
    wait_for(lambda: delivery._asleep)
    transport.full = True
    r.reward(2.0, "partial")
    assert recorder.stats.queued == 1 and Counting.sets == 1  # a queued event wakes it
    transport.full = False
    r.finish()
    assert recorder.flush(10)
    recorder.close()
    assert_exactly_once_in_order(consumed(transport), 4)


def test_without_a_spool_the_client_buffers_then_drops_and_counts(tmp_path: Path) -> None:
    transport = MemoryTransport(capacity=4)
    transport.available = False
    recorder = Recorder(make_settings(tmp_path, spool_dir=None, queue_size=3), transport=transport)
    record_rollouts(recorder, 1, 10)  # the queue (3) and the client (4) fill; the rest drops

    def settled() -> bool:
        s = recorder.stats
        return s.queued == 0 or s.in_flight == 4

    wait_for(settled)
    assert recorder.stats.dropped > 0
    stats = recorder.close(timeout=0.1)
    assert (stats.dropped, stats.submitted, stats.sent) == (10, 10, 0)


def test_without_a_spool_a_short_outage_loses_nothing(tmp_path: Path) -> None:
    transport = MemoryTransport()
    recorder = Recorder(make_settings(tmp_path, spool_dir=None), transport=transport)
    transport.available = False
    record_rollouts(recorder, 3, 10)
    time.sleep(0.4)  # longer than degrade_after_s: still no spool mode without a spool
    transport.available = True
    assert recorder.flush(5)
    assert recorder.close().dropped == 0
    assert_exactly_once_in_order(consumed(transport), 30)


def test_close_while_down_then_a_new_recorder_drains_the_spool(tmp_path: Path) -> None:
    transport = MemoryTransport()  # the broker's log outlives both recorders
    first = Recorder(make_settings(tmp_path), transport=transport)
    record_rollouts(first, 2, 10, "a")
    assert first.flush(5)
    transport.available = False
    r = first.rollout(task_id="open", group_id="g")
    record_rollouts(first, 4, 10, "b")
    for j in range(10):
        r.reward(j)
    stats = first.close(timeout=0.3)
    assert stats.spool_backlog == 0  # the spool is closed; its files hold the events
    left = Spool(tmp_path / "spool")
    assert left.backlog == 4 * 10 + 11
    left.close()
    transport.available = True
    second = Recorder(make_settings(tmp_path), transport=transport)
    assert second.flush(10)
    record_rollouts(second, 1, 5, "c")
    assert second.flush(5)
    second.close()
    assert_exactly_once_in_order(consumed(transport), 2 * 10 + 4 * 10 + 11 + 5)


def test_events_the_broker_wrote_but_never_acked_are_not_sent_twice(tmp_path: Path) -> None:
    transport = MemoryTransport()
    first = Recorder(make_settings(tmp_path, degrade_after_s=30), transport=transport)
    transport.available = False
    record_rollouts(first, 3, 10)
    wait_for(lambda: first.stats.in_flight == 30)
    transport.persist_in_flight()  # the broker wrote them, then died before answering
    first.close(timeout=0.2)  # purged in flight -> spooled as uncertain
    transport.available = True
    second = Recorder(make_settings(tmp_path), transport=transport)
    assert second.flush(10)
    stats = second.close()
    assert stats.deduplicated == 30 and stats.sent == 0
    assert_exactly_once_in_order(consumed(transport), 30)


def test_unverifiable_uncertain_events_are_resent_not_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    transport = MemoryTransport()
    first = Recorder(make_settings(tmp_path, degrade_after_s=30), transport=transport)
    transport.available = False
    record_rollouts(first, 1, 5)
    wait_for(lambda: first.stats.in_flight == 5)
    first.close(timeout=0.1)
    transport.available, transport.readable = True, False
    second = Recorder(make_settings(tmp_path), transport=transport)
    assert second.flush(10)
    second.close()
    assert len(consumed(transport)) == 5
    assert "could not check 5 uncertain" in caplog.text


def test_message_timeout_in_the_client_moves_events_back_to_the_spool(tmp_path: Path) -> None:
    transport = MemoryTransport(message_timeout_s=0.1)
    recorder = Recorder(make_settings(tmp_path, degrade_after_s=5), transport=transport)
    transport.available = False
    record_rollouts(recorder, 2, 10, "a")
    wait_for(lambda: recorder.stats.state == "degraded")  # a delivery failed (timed out)
    record_rollouts(recorder, 2, 10, "b")
    wait_for(lambda: recorder.stats.spool_backlog == 40)
    transport.available = True
    assert recorder.flush(10)
    recorder.close()
    assert_exactly_once_in_order(consumed(transport), 40)


def test_harness_never_sees_transport_errors(tmp_path: Path) -> None:
    class Broken(MemoryTransport):
        def produce(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("client exploded")

    recorder = Recorder(make_settings(tmp_path), transport=Broken())
    record_rollouts(recorder, 1, 4)
    assert recorder.flush(5)
    assert recorder.close().failed == 4


def test_after_close_events_are_dropped_and_counted(tmp_path: Path) -> None:
    recorder = Recorder(make_settings(tmp_path), transport=MemoryTransport())
    r = recorder.rollout(task_id="t", group_id="g")
    recorder.close()
    r.reward(1.0)
    assert recorder.stats.dropped == 1


def test_exit_without_close_spools_at_exit(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        from rollstream.producers import MemoryTransport, Recorder, RecorderSettings
        t = MemoryTransport()
        t.available = False
        rec = Recorder(RecorderSettings(namespace="x", spool_dir={str(tmp_path / "spool")!r},
                                        close_timeout_s=0.2), transport=t)
        with rec.rollout(task_id="t", group_id="g") as r:
            r.reward(1.0)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    spool = Spool(tmp_path / "spool")
    assert spool.backlog == 3
    spool.close()


def test_unusable_spool_dir_does_not_stop_the_harness(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    transport = MemoryTransport()
    with Recorder(make_settings(tmp_path, spool_dir=blocker / "spool"), transport=transport) as rec:
        record_rollouts(rec, 1, 3)
        assert rec.flush(5)
    assert len(consumed(transport)) == 3
    assert "spool disabled" in caplog.text


def test_ulids_are_unique_across_threads_and_a_fork() -> None:
    import os
    import threading

    from ulid import ULID

    from rollstream.producers.sdk.ids import new_ulid

    out: list[list[str]] = [[] for _ in range(8)]

    def make(bucket: list[str]) -> None:
        bucket.extend(new_ulid() for _ in range(5000))

    threads = [threading.Thread(target=make, args=(b,)) for b in out]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [i for b in out for i in b]
    assert len(set(ids)) == len(ids) == 40_000
    assert all(b == sorted(b) for b in out)  # monotonic per thread
    assert str(ULID.from_str(ids[0])) == ids[0]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's ids, made in the same milliseconds as the parent's
        os.write(write, ",".join(new_ulid() for _ in range(200)).encode())
        os._exit(0)
    mine = [new_ulid() for _ in range(200)]
    os.waitpid(pid, 0)
    os.close(write)
    theirs = os.read(read, 1 << 16).decode().split(",")
    assert len(theirs) == 200 and not set(theirs) & set(mine)


def test_ulids_in_one_millisecond_count_up_by_one_and_carry() -> None:
    from rollstream.producers.sdk.ids import new_ulid

    ids = [new_ulid() for _ in range(20_000)]
    values = [int(ULID.from_str(i)) for i in ids]
    assert all(str(ULID.from_str(i)) == i for i in ids)
    same_ms = [
        (a, b)
        for a, b, x, y in zip(values, values[1:], ids, ids[1:], strict=False)
        if x[:10] == y[:10]
    ]
    assert len(same_ms) > 1000 and all(b == a + 1 for a, b in same_ms)
    assert any(b & 31 == 0 for _, b in same_ms)  # the increment carried past the last digit
    assert values == sorted(values) and len(set(ids)) == len(ids)


def test_failed_kafka_deliveries_spool_exactly_what_failed(tmp_path: Path) -> None:
    """With the real librdkafka client and no broker: messages time out in the client (then the
    rest are purged at close), and the spool ends up with exactly those messages, byte for byte
    with their timestamps, flagged uncertain (the report callback carries each message)."""
    from rollstream.infra.kafka import free_port
    from rollstream.producers import Delivery, KafkaTransport

    nowhere = {"bootstrap.servers": f"127.0.0.1:{free_port()}"}
    transport = KafkaTransport(nowhere, {"message.timeout.ms": 300, "linger.ms": 0})
    spool = Spool(tmp_path / "spool")
    delivery = Delivery(
        transport, spool=spool, probe_topic="t", degrade_after_s=60, probe_interval_s=60
    )
    sent = [("t", b"k%d" % i, b"v%d" % i, 1_000 + i) for i in range(5)]
    for topic, key, value, ts in sent[:3]:
        delivery.submit(topic, key, value, ts)
    wait_for(lambda: delivery.stats.spooled == 3)  # timed out -> degraded -> moved to the spool
    for topic, key, value, ts in sent[3:]:
        delivery.submit(topic, key, value, ts)  # degraded: straight to the spool, behind them
    stats = delivery.close(timeout=0.2)
    assert (stats.sent, stats.failed, stats.dropped, stats.spooled) == (0, 0, 0, 5)
    left = Spool(tmp_path / "spool")
    records = left.read()
    left.close()
    assert [(r.topic, r.key, r.value, r.ts_ms) for r in records] == sent
    assert [r.uncertain for r in records] == [True, True, True, False, False]


def test_bench_proxy_sink_transport_keeps_up_with_the_transport_protocol(tmp_path: Path) -> None:
    """bench/bench_proxy.py records through its own SinkTransport; when the Transport protocol
    changed, it went stale unnoticed (it acked with one argument) and the bench stopped."""
    import importlib.util

    path = Path(__file__).parents[2] / "bench" / "bench_proxy.py"
    spec = importlib.util.spec_from_file_location("bench_proxy_under_test", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    transport = bench.SinkTransport()
    with Recorder(make_settings(tmp_path, spool_dir=None), transport=transport) as rec:
        with rec.rollout(task_id="t", group_id="g") as r:
            r.llm_call([1, 2, 3], [4, 5], [-0.1, -0.2])
        assert rec.flush(5)
        assert rec.stats.sent == 3 and rec.stats.failed == 0
    assert transport.records == 3


@pytest.mark.parametrize("flat", [True, False], ids=["flat-writer", "records"])
def test_llm_call_ids_and_bytes_on_both_encode_paths(tmp_path: Path, flat: bool) -> None:
    """LlmCall events written from their fields (the hot path) decode to what the record path
    makes; an SDK-made call id is also the event's id, a given one is not; a field of the wrong
    type raises before the trie records the call, so the next call's parent is a real event."""
    transport = MemoryTransport()
    recorder = Recorder(make_settings(tmp_path), transport=transport)
    if not flat:
        recorder._write_llm_call = recorder._llm_call_as_records  # as with a schema registry
    with recorder, recorder.rollout(task_id="t", group_id="g", policy_version=4) as r:
        first = r.llm_call([1, 2, 3], [4, 5], [-0.5, -0.25], model="m", latency_ms=2)
        with pytest.raises(RecorderUsageError, match="cannot encode LlmCall"):
            r.llm_call([1, 2, 3, 4, 5, 6], [7], [-0.1], model=None)  # type: ignore[arg-type]
        with pytest.raises(RecorderUsageError, match="cannot encode LlmCall"):
            r.llm_call([1, 2, 3, 4, 5, 6], [7], [-0.1], drift_tokens="2")  # type: ignore[arg-type]
        mine = r.llm_call(
            [1, 2, 3, 4, 5, 9],
            [8],
            [-1.0],
            call_id="mine",
            usage=Usage(6, 1, 3),
            backend="b",
            drift_tokens=np.int64(2),  # numpy's ints are ints here, as for the encoder
        )
    assert mine == "mine"
    events = consumed(transport)
    assert [e.seq for e in events] == [0, 1, 2, 3]
    a, b = events[1], events[2]
    assert isinstance(a.body, LlmCall) and isinstance(b.body, LlmCall)
    assert a.event_id == a.body.call_id == first
    assert b.body.call_id == "mine" and b.event_id != "mine"
    ULID.from_str(b.event_id)
    assert a.body == LlmCall(
        first, None, 0, [1, 2, 3], [4, 5], [-0.5, -0.25], "stop", "m", "", 4, 2.0, Usage(3, 2, 0)
    )
    assert b.body == LlmCall(
        "mine", first, 5, [9], [8], [-1.0], "stop", "", "b", 4, 0.0, Usage(6, 1, 3), 2
    )
    assert a.producer == b.producer == "unit-test" and a.schema_version == b.schema_version == 1


def test_the_sdk_import_path_stays_light() -> None:
    """``import rollstream.producers`` (the Recorder) loads none of the proxy's libraries."""
    heavy = ["httpx", "starlette", "orjson", "tokenizers", "jinja2", "ulid", "uvicorn"]
    code = (
        "import sys, rollstream.producers\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {set(heavy)!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_recorder_builds_its_codec_from_its_settings() -> None:
    settings = RecorderSettings(spool_dir=None, namespace=NS)
    with Recorder(settings, transport=MemoryTransport()) as recorder:
        assert isinstance(recorder.codec, Codec) and recorder.codec.registry is None
    codec = Codec()
    with Recorder(settings, transport=MemoryTransport(), codec=codec) as recorder:
        assert recorder.codec is codec


def test_a_full_spool_stops_accepting_and_tells_the_harness(tmp_path: Path) -> None:
    """Kafka down, a spool bounded to 64 KiB: once it is full, ``accepting`` is False, every
    event dropped is counted and told to ``on_drop`` with the reason; when Kafka is back and
    the spool drains, it accepts again and every event it kept arrives exactly once."""
    transport = MemoryTransport()
    told: list[tuple[int, str]] = []
    recorder = Recorder(
        make_settings(tmp_path, spool_max_bytes=1 << 16, queue_size=10),
        transport=transport,
        on_drop=lambda n, reason: told.append((n, reason)),
    )
    assert recorder.accepting and recorder.stats.accepting
    transport.available = False
    r = recorder.rollout(task_id="t", group_id="g")
    wait_for(lambda: (r.reward(0.5, "partial"), recorder.stats.state == "degraded")[1])
    while recorder.accepting:
        r.reward(0.25, "partial")  # ~90 bytes an event: the 64 KiB spool fills
    assert recorder.stats.spool_backlog > 0 and not recorder.stats.accepting
    assert recorder.stats.dropped == 0  # "full" leaves a reserve for work taken before
    for _ in range(1_000):  # a harness that goes on regardless: past the bound, dropped
        r.reward(1.0, "partial")
    wait_for(lambda: sum(n for n, _ in told) == recorder.stats.dropped > 0)
    assert all("spool_max_bytes" in reason for _, reason in told)
    transport.available = True
    wait_for(lambda: recorder.accepting and recorder.stats.spool_backlog == 0, timeout=10)
    r.finish()
    stats = recorder.close()
    kept = consumed(transport)
    assert len(kept) == stats.submitted - stats.dropped and stats.failed == 0
    assert len({e.event_id for e in kept}) == len(kept)  # exactly once


def test_a_branch_point_hangs_the_next_call_under_its_source(tmp_path: Path) -> None:
    transport = MemoryTransport()
    with Recorder(make_settings(tmp_path), transport=transport) as recorder:
        with recorder.rollout(task_id="t", group_id="g") as r:
            lp = np.zeros(1, np.float32)
            x = r.llm_call([1, 2, 3], [4], lp)
            r.llm_call([1, 2, 3, 4, 7, 8], [9], lp)  # y: x's sequence + a header 7 + more
            r.branch("rewind", source_call_id=x, reason="back to x")
            r.llm_call([1, 2, 3, 4, 7, 5], [6], lp)  # from x again, sharing the header with y
        assert recorder.flush(5)
    calls = [e.body for e in consumed(transport) if isinstance(e.body, LlmCall)]
    assert (calls[2].parent_call_id, calls[2].prefix_len) == (x, 4)
    assert calls[2].prompt_delta.tolist() == [7, 5]
