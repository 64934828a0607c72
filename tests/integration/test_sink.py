"""The ClickHouse sink on the real broker and real chDB (``rollstream sink``
as a subprocess; every check goes through its analytics server): SDK events land in the tables,
offsets are committed only after the insert, poison records go to the DLQ and the sink goes on,
and SIGKILLs at random moments lose and duplicate nothing.

The kill loop runs 20 kills over 20,000 events here, once with decode + map in the consume loop
and once in worker processes (sink_map_workers=2: their results are inserted in the order the
batches were cut, and they do not outlive a SIGKILLed sink); RS_IT_SINK_KILLS and
RS_IT_SINK_EVENTS scale it (the issue's full size: RS_IT_SINK_KILLS=100
RS_IT_SINK_EVENTS=200000)."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _kafka_read import read_topic
from _sink_process import (
    Committed,
    SinkProcess,
    ends_of,
    produce,
    record_rollouts,
    wait_committed,
)

from rollstream.consumers.analytics.client import AnalyticsClient
from rollstream.schemas import (
    Codec,
    CommonSettings,
    Event,
    PolicyVersion,
    RolloutStarted,
    Sample,
    Trajectory,
)
from rollstream.schemas.dlq import HEADER_NAMES, read_headers
from rollstream.streams.core import GroupClosed, add_to_group, replay

pytestmark = pytest.mark.integration

codec = Codec()


# --- fixtures ---


@pytest.fixture
def sink_factory(tmp_path: Path) -> Iterator[Any]:
    started: list[SinkProcess] = []

    def make(settings: CommonSettings, **env: str) -> SinkProcess:
        sink = SinkProcess(settings, tmp_path, **env)
        started.append(sink)
        return sink

    yield make
    for sink in started:
        sink.stop()


# --- tests --------------------------------------------------------------------------------------


def test_sdk_events_land_in_the_tables_and_offsets_follow_inserts(
    kafka_settings: CommonSettings, tmp_path: Path, sink_factory: Any
) -> None:
    topics = kafka_settings.topics()
    record_rollouts(kafka_settings, tmp_path, 24)
    messages = read_topic(kafka_settings, topics.events)
    events: list[Event] = [codec.decode(m.value(), expect=Event) for m in messages]
    # derived records from the pure core, so the other three tables get real rows too
    events.sort(key=lambda e: (e.rollout_id, e.seq))
    trajectories = [t for t in replay(events)[1] if isinstance(t, Trajectory)]
    samples: list[Sample] = []
    groups: dict[str, Any] = {}
    for t in trajectories:
        groups[t.group_id], outs = add_to_group(groups.get(t.group_id), t)
        samples += [s for o in outs if isinstance(o, GroupClosed) for s in o.samples]
    assert len(trajectories) == 24 and samples
    produce(kafka_settings, topics.trajectories,
            [(t.rollout_id.encode(), codec.encode(t)) for t in trajectories])  # fmt: skip
    produce(kafka_settings, topics.samples,
            [(s.group_id.encode(), codec.encode(s)) for s in samples])  # fmt: skip
    policy = PolicyVersion(1, "ckpt/1", 10, 1_735_689_600_000_000)
    produce(kafka_settings, topics.policy, [(None, codec.encode(policy))])

    # a slow commit (after every insert) so the test sees inserted-but-not-committed batches
    sink = sink_factory(
        kafka_settings, sink_batch_messages="20", sink_flush_interval_s="0.2",
        sink_debug_commit_delay_s="0.4",
    )  # fmt: skip
    sink.start()
    sink.wait_ready()
    ends = ends_of(kafka_settings, [topics.events])
    committed = Committed(kafka_settings)
    ahead = 0
    try:
        with sink.client() as api:
            deadline = time.monotonic() + 90
            while True:
                now = committed(list(ends))  # first the commits, then what is stored
                stored = {
                    (topics.events, int(p)): set(offsets)
                    for p, offsets in api.query(
                        "SELECT kafka_partition, groupArray(kafka_offset) FROM events "
                        "GROUP BY kafka_partition"
                    ).rows
                }
                for key, offset in now.items():
                    missing = set(range(offset)) - stored.get(key, set())
                    assert not missing, f"{key} committed {offset} before inserting {missing}"
                    ahead += len(stored.get(key, set())) > offset
                if all(now[k] >= end for k, end in ends.items()):
                    break
                assert time.monotonic() < deadline, sink.log_tail()
                time.sleep(0.05)
            assert ahead > 0, "never saw an insert ahead of its commit"
            wait_committed(committed, ends_of(kafka_settings, [
                topics.trajectories, topics.samples, topics.policy]), sink, 60)  # fmt: skip

            ids = set(api.query("SELECT event_id FROM events").column("event_id"))
            assert ids == {e.event_id for e in events}
            by_type = dict(api.query("SELECT type, count() FROM events GROUP BY type").rows)
            assert by_type == {
                "RolloutStarted": 24, "LlmCall": 48, "ToolCall": 24, "Branch": 24,
                "RolloutError": 24, "Reward": 24, "RolloutFinished": 24,
            }  # fmt: skip
            counts = {
                table: api.query(f"SELECT count() FROM {table}").rows[0][0]
                for table in ("llm_calls", "tool_calls", "rewards", "rollouts", "trajectories",
                              "samples", "policy_versions")
            }  # fmt: skip
            assert counts == {
                "llm_calls": 48, "tool_calls": 24, "rewards": 24, "rollouts": 24 * 3,
                "trajectories": 24, "samples": len(samples), "policy_versions": 1,
            }  # fmt: skip
            # the tables hold what the records say (a token array read back)
            call = next(e for e in events if type(e.body).__name__ == "LlmCall")
            row = api.query(
                "SELECT completion_ids FROM llm_calls WHERE event_id = {id:String}",
                {"id": call.event_id},
            ).rows[0]
            assert list(row[0]) == call.body.completion_ids.tolist()
            health = api.health()
            assert health["sink"]["dead_letters"] == 0
    finally:
        committed.close()


MAP_WORKERS = pytest.mark.parametrize("workers", ["0", "2"], ids=["in-loop", "map-workers"])


@MAP_WORKERS
def test_poison_records_go_to_the_dlq_and_the_sink_goes_on(
    kafka_settings: CommonSettings, tmp_path: Path, sink_factory: Any, workers: str
) -> None:
    topics = kafka_settings.topics()
    sink = sink_factory(kafka_settings, sink_flush_interval_s="0.2", sink_map_workers=workers)
    sink.start()
    sink.wait_ready()
    record_rollouts(kafka_settings, tmp_path, 3, seed=1)
    bad_ts = Event("bad-ts", "r-bad", 0, -5, RolloutStarted("t", "g"), "it")
    wrong_type = PolicyVersion(3, "ckpt/3", 3, 0)
    poison = [
        (b"r-garbage", b"\x00\x01 not avro at all"),
        (b"r-bad", codec.encode(bad_ts)),
        (b"r-wrong", codec.encode(wrong_type)),
    ]
    produce(kafka_settings, topics.events, poison)
    record_rollouts(kafka_settings, tmp_path, 3, seed=2)  # after the poison: still stored
    ends = ends_of(kafka_settings, [topics.events])
    committed = Committed(kafka_settings)
    try:
        wait_committed(committed, ends, sink, 60)
    finally:
        committed.close()
    valid = {
        codec.decode(m.value(), expect=Event).event_id
        for m in read_topic(kafka_settings, topics.events)
        if m.key() not in {k for k, _ in poison}
    }
    with sink.client() as api:
        assert set(api.query("SELECT event_id FROM events").column("event_id")) == valid
        assert len(valid) == 6 * 8
    dead = read_topic(kafka_settings, topics.dlq)
    assert len(dead) == 3
    by_key = {m.key(): m for m in dead}
    for key, value in poison:
        msg = by_key[key]
        assert msg.value() == value  # unchanged
        assert [k for k, _ in msg.headers()] == list(HEADER_NAMES)  # the one DLQ contract
        headers = read_headers(msg.headers())
        assert headers["original_topic"] == topics.events
        assert headers["stage"] == "sink" and headers["reason"]
        assert headers["processor"] == topics.name("rollstream-sink-v1")
        assert int(headers["original_offset"]) >= 0
    h = read_headers(by_key[b"r-bad"].headers())
    assert (h["code"], h["kind"]) == ("unmappable", "RolloutStarted")
    assert "ts -5" in h["reason"]
    h = read_headers(by_key[b"r-garbage"].headers())
    assert (h["code"], h["kind"]) == ("undecodable", "")
    h = read_headers(by_key[b"r-wrong"].headers())
    assert h["code"] == "undecodable" and "expected Event" in h["reason"]


KILLS = int(os.environ.get("RS_IT_SINK_KILLS", "20"))


@MAP_WORKERS
@pytest.mark.timeout(max(600, 15 * KILLS))  # 100 kills took 495 s (in loop) on the dev box
def test_sigkill_in_a_loop_loses_and_duplicates_nothing(
    kafka_settings: CommonSettings, tmp_path: Path, sink_factory: Any, workers: str
) -> None:
    kills = KILLS
    n_events = int(os.environ.get("RS_IT_SINK_EVENTS", "20000"))
    rollouts = n_events // 8  # 8 events per rollout
    topics = kafka_settings.topics()
    # small aligned batches, a short flush timer (intents) and a slow commit: most kills land
    # between an insert and its commit, or between an intent and its insert
    sink = sink_factory(
        kafka_settings, sink_batch_messages="400", sink_flush_interval_s="0.25",
        sink_debug_commit_delay_s="0.3", sink_map_workers=workers,
    )  # fmt: skip
    producing = threading.Thread(
        target=record_rollouts,
        args=(kafka_settings, tmp_path, rollouts),
        kwargs={"seed": 3, "pace_s": 3.0 * kills / rollouts},  # events come while it is killed
        daemon=True,
    )
    producing.start()
    rng = random.Random(7)
    for _ in range(kills):
        sink.start()
        sink.wait_ready()
        deadline = time.monotonic() + 10  # until this run stores something, then at random
        while " inserted " not in sink.current_log() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 1.2))
        workers_before = _map_workers(sink)
        assert len(workers_before) == int(workers)
        sink.kill()
        _assert_gone(workers_before)
    producing.join(300)
    assert not producing.is_alive()
    sink.start()
    sink.wait_ready()
    ends = ends_of(kafka_settings, [topics.events])
    assert sum(ends.values()) == rollouts * 8
    committed = Committed(kafka_settings)
    try:
        wait_committed(committed, ends, sink, 300)
    finally:
        committed.close()
    produced = {
        codec.decode(m.value(), expect=Event).event_id
        for m in read_topic(kafka_settings, topics.events)
    }
    with sink.client() as api:
        raw = api.query("SELECT count() FROM events").rows[0][0]
        final, distinct = api.query("SELECT count(), uniqExact(event_id) FROM events FINAL").rows[0]
        stored = set(api.query("SELECT event_id FROM events FINAL").column("event_id"))
        llm_raw = api.query("SELECT count() FROM llm_calls").rows[0][0]
    mid_batch = sink.killed_mid_batch()
    print(
        f"\nkill loop: {kills} kills ({mid_batch} between an insert and its commit), "
        f"{len(produced)} events, raw rows {raw}, FINAL rows {final}, llm_calls raw {llm_raw}"
    )
    lost, extra = sorted(produced - stored), sorted(stored - produced)
    assert not lost and not extra, f"{len(lost)} lost (e.g. {lost[:5]}), {len(extra)} extra"
    assert final == distinct == len(produced)  # none duplicated after FINAL
    assert mid_batch >= kills // 4, "too few kills hit a batch in flight to prove anything"
    # the batch boundaries were reproduced after every crash: the tokens caught every retry
    assert raw == len(produced)
    assert llm_raw == 2 * rollouts


def _map_workers(sink: Any) -> list[int]:
    """Pids of the sink process's map workers (its children running store/workers.py)."""
    assert sink.proc is not None
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == sink.proc.pid and b"rollstream.consumers.store.workers" in cmd:
            out.append(int(entry.name))
    return out


def _assert_gone(pids: list[int], timeout: float = 30.0) -> None:
    """The processes exit (a SIGKILLed sink's workers see their pipe close)."""
    deadline = time.monotonic() + timeout
    alive = pids
    while alive:
        alive = [p for p in alive if Path(f"/proc/{p}").exists() and not _zombie(p)]
        assert time.monotonic() < deadline, (
            f"map workers outlived the killed sink: {[_describe(p) for p in alive]}"
        )
        time.sleep(0.05)


def _describe(pid: int) -> str:
    try:
        proc = Path(f"/proc/{pid}")
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        fds = {fd.name: os.readlink(fd) for fd in (proc / "fd").iterdir()}
        return f"{pid} {state} {(proc / 'wchan').read_text()} {fds}"
    except OSError as exc:
        return f"{pid}: {exc}"


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def test_analytics_client_refuses_writes_and_reports(
    kafka_settings: CommonSettings, tmp_path: Path, sink_factory: Any
) -> None:
    sink = sink_factory(kafka_settings)
    sink.start()
    sink.wait_ready()
    record_rollouts(kafka_settings, tmp_path, 4, seed=4)
    committed = Committed(kafka_settings)
    try:
        wait_committed(committed, ends_of(kafka_settings, [kafka_settings.topics().events]),
                       sink, 60)  # fmt: skip
    finally:
        committed.close()
    api: AnalyticsClient
    with sink.client() as api:
        from rollstream.consumers.errors import AnalyticsHTTPError, RefusedQuery

        for statement in (
            "INSERT INTO events SELECT * FROM events",
            "DROP TABLE events",
            "SELECT 1; DROP TABLE events",
            "SELECT 1 INTO OUTFILE '/tmp/x'",
            "ALTER TABLE events DELETE WHERE 1",
            "SELECT * FROM file('/etc/hostname', 'LineAsString')",
            "SELECT 1 SETTINGS max_execution_time = 100000",
        ):
            with pytest.raises(RefusedQuery):
                api.query(statement)
        # the session is readonly=1 underneath the checks (test_analytics_lockdown_chdb.py)
        with pytest.raises(AnalyticsHTTPError, match="max rows"):
            api.query("SELECT number FROM numbers(2000000)")
        status = api.report("rollouts_by_status")
        assert status.rows == [("completed", 4, 1.0)]
        assert api.query("SELECT count() FROM events").rows == [(32,)]
