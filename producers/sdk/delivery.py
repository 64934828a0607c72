"""Delivery: gets encoded events from inside a harness to Kafka, exactly once and in order per
key, without ever raising into or blocking the harness.

Design (``submit`` hands an event to the client or queues it; one background thread per ``Delivery``
serves the client's reports and owns every decision after that):

    harness threads --submit--> [bounded in-memory queue] --thread--> Transport (librdkafka)
              \\ (queue full, spool mode)                     \\ failed / still held at close
               `--------> [local spool, append-only] <---------'   (prepended, in front)
                                    `--thread (when Kafka is back), in order--> Transport

* ``submit`` takes a lock and, when nothing waits in front of the event (no queue, no spool,
  no unsettled failure), hands it to the client itself (librdkafka's produce: non-blocking, a
  copy into its buffer); otherwise, or when the client's buffer is full, it appends to the
  queue, which the thread hands over in order. Never blocks, never raises. When the queue is
  full, or while the spool is in use, the event is appended to the spool instead (one write,
  no fsync unless the policy says so); once anything is spooled or queued, every later event
  goes behind it, so order per key (per rollout) always holds. The thread serves the client's
  delivery reports (poll) either way. (Handing over from the harness's thread saves the queue
  hop and the thread's wake-ups: ~3 us of CPU per event, docs/benchmarks.md.)
* The client is an idempotent librdkafka producer (``enable.idempotence``, ``acks=all``): its
  own retries never duplicate and keep order per partition. ``message.timeout.ms`` is generous
  (5 min) so a broker restart is covered by librdkafka alone.
* Kafka is judged unreachable ("degraded") when a delivery fails, when nothing was acknowledged
  for ``degrade_after_s`` while messages wait, or when a leftover spool needs draining. Then the
  thread stops handing events to the client, and new events go to the spool. Messages already
  in the client stay there (librdkafka keeps retrying them); once all of them are settled, the
  failed ones and the events still in memory are PREPENDED to the spool: they are older than
  everything spooled since. A metadata probe runs every ``probe_interval_s``; when it answers,
  the spool is drained in order (acked record by record, so a crash mid-drain re-sends nothing
  already acknowledged beyond the last persisted ack offset) and events go direct again.
* Only events whose delivery failed or that never reached the client are spooled; an
  acknowledged event is never re-sent. A failed delivery may still have been written by the
  broker (it died before answering, or the message was purged in flight at exit); such records
  are flagged *uncertain* and, before they are re-sent, the topic is read from their timestamp
  on (``Transport.delivered``) and those already there are skipped. Consumers thus see every
  event exactly once without deduplicating.
* ``close(timeout)`` (also run by ``atexit``) delivers what it can until the deadline, then
  purges the client and spools what is left, so the next process (same spool slot) sends it
  first. A process killed with SIGKILL loses only what was in memory (queue, client buffers).
* Counters (``DeliveryStats``): sent, spooled, failed (rejected for good, e.g. too large, logged),
  dropped (neither sent nor spooled: spool unusable or full, or submitted after close),
  deduplicated; ``accepting``: whether a new event would be kept now. Every drop is also told
  to the ``on_drop(events, reason)`` callback, when one is given (outside the lock).
* Backpressure: the spool is bounded (``Spool.max_bytes``); once Kafka is unreachable and the
  spool is full or failing, ``accepting`` is False, so a service that records what it does (the
  proxy) answers 503 with Retry-After instead of taking work whose events it would lose.
* The transport is a small protocol at the I/O edge: ``KafkaTransport`` (confluent-kafka) and
  ``MemoryTransport`` (in memory, with fault injection, for unit tests).
* Without a spool (``spool=None``) nothing degrades: the client buffers and retries until
  ``message.timeout.ms``; what it cannot take, and what fails, is dropped and counted.

Limits, stated plainly: the "behind it" rule is applied to all keys at once (simpler, and an
outage spools everything anyway). After a hard crash, records acked since the last persisted
ack offset (``spool_fsync`` policy) are sent again. Checking uncertain records needs read access
to the topic; without it they are re-sent (at-least-once, logged). If librdkafka times a message
out and a later one of the same partition still succeeds, the re-sent one lands after it; with
a 5-minute timeout and the thread holding new events back once degraded, this needs an outage
that ends inside a window of milliseconds.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from rollstream.producers.sdk.spool import Spool, SpoolError, SpoolItem, SpoolRecord, record_digest
from rollstream.producers.sdk.transport import (
    DeliveryError,
    KafkaTransport,
    MemoryTransport,
    Transport,
)

__all__ = [
    "Delivery",
    "DeliveryError",
    "DeliveryStats",
    "KafkaTransport",
    "MemoryTransport",
    "Transport",
]

log = logging.getLogger("rollstream.producers")

HEALTHY, DEGRADED, CLOSED = "healthy", "degraded", "closed"
_BATCH = 2000  # messages handed to the client per step before serving delivery reports
_LINGER_S = 0.001  # while busy, the thread looks for new events this often (like linger.ms)
_NAP_FOR_S = 0.2  # ... for this long after the last event, then sleeps until woken


@dataclass(frozen=True, slots=True)
class DeliveryStats:
    submitted: int = 0  # events given to submit()
    sent: int = 0  # acknowledged by Kafka (acks=all)
    spooled: int = 0  # writes to the local spool (overflow, outage, failed deliveries moved back)
    failed: int = 0  # rejected by Kafka for good (e.g. too large): logged, not retried
    dropped: int = 0  # neither sent nor spooled (spool unusable, or submitted after close)
    deduplicated: int = 0  # uncertain spooled events found already in Kafka, not re-sent
    queued: int = 0  # in memory now
    in_flight: int = 0  # handed to the client, not yet acknowledged
    spool_backlog: int = 0  # in the spool now
    state: str = HEALTHY
    accepting: bool = True  # a new event would be kept (sent, queued or spooled), not dropped


@dataclass(slots=True)
class _Failure:
    item: SpoolItem  # flagged uncertain: the broker may have written it before failing
    record: SpoolRecord | None  # where it came from in the spool, acked once spooled again


class Delivery:
    """Background delivery of (topic, key, value) records through a ``Transport``."""

    def __init__(
        self,
        transport: Transport,
        *,
        spool: Spool | None,
        probe_topic: str,
        queue_size: int = 10_000,
        degrade_after_s: float = 10.0,
        probe_interval_s: float = 1.0,
        close_timeout_s: float = 30.0,
        on_drop: Callable[[int, str], None] | None = None,
    ) -> None:
        self.transport = transport
        self.on_drop = on_drop  # (events, reason), from the thread that dropped them, unlocked
        self._drops: list[tuple[int, str]] = []  # not yet told to on_drop
        self._spool_refused_until = 0.0  # a spool write failed: not accepting until then
        self.spool = spool
        self.probe_topic = probe_topic
        self.queue_size = queue_size
        self.degrade_after_s = degrade_after_s
        self.probe_interval_s = probe_interval_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._asleep = False  # the thread sleeps long and must be woken (see _idle_wait)
        self._active_at = 0.0  # last time the thread moved an event
        self._closing = threading.Event()
        self._deadline = float("inf")
        self._queue: deque[SpoolItem] = deque()
        self._to_spool = bool(spool is not None and spool.backlog)
        self._state = DEGRADED if self._to_spool else HEALTHY
        self._next_probe = 0.0
        # handed to the client, no report yet: a number -> its report callback (a partial over
        # the number, the record's fields and its spool record: the only per-message object the
        # cyclic GC tracks for long; its arguments are atomic, so their tuple is untracked at
        # the first collection). The client calls it directly.
        self._pending: dict[int, functools.partial[None]] = {}
        self._numbers = itertools.count()  # next() is atomic: both threads hand over
        self._busy_since = 0.0  # when _pending last became non-empty
        self._report = self._on_report  # bound once: a partial over it is made per message
        self._failures: list[_Failure] = []
        self._known: set[bytes] = set()  # uncertain spooled records found already in Kafka
        self._last_ok = time.monotonic()
        self._last_drop_log = 0.0
        self._closed = False
        self._warned_closed = False
        self._submitted = self._sent = self._spooled = 0
        self._failed = self._dropped = self._deduplicated = 0
        self._acked = False  # a delivery report said OK since the last round
        self._now = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="rollstream-delivery", daemon=True)
        self._at_exit = functools.partial(_close_at_exit, weakref.ref(self), close_timeout_s)
        self._thread.start()
        atexit.register(self._at_exit)

    # --- harness side -----------------------------------------------------------------------

    def submit(self, topic: str, key: bytes, value: bytes, timestamp_ms: int | None = None) -> None:
        """Hand over one record. Never blocks on the network, never raises."""
        ts_ms = timestamp_ms or int(time.time() * 1000)
        with self._lock:
            self._submitted += 1
            if self._closed:
                self._drop(1, "submitted after the recorder was closed")
                if not self._warned_closed:
                    self._warned_closed = True
                    log.warning("event submitted after the recorder was closed: dropped")
                return
            if not self._to_spool:
                # the usual case: nothing waits in front of it, so this thread hands it to the
                # client itself (non-blocking; False when the client's buffer is full)
                if (
                    not self._queue
                    and not self._failures
                    and self._produce(topic, key, value, ts_ms, None)
                ):
                    # not woken for it: its report waits for the thread's next look (within
                    # the 50 ms of _idle_wait's sleep); a wake per event would cost this thread
                    # a context switch and the GIL's handover on every record
                    return
                if len(self._queue) < self.queue_size:
                    self._queue.append(SpoolItem(topic, key, value, ts_ms))
                    if self._asleep:  # read after the append: see _idle_wait
                        self._wake.set()
                    return
                self._to_spool = True
                log.warning(
                    "delivery queue full (%d events): spooling new events to %s",
                    self.queue_size,
                    self._where(),
                )
            self._spool_locked([SpoolItem(topic, key, value, ts_ms)], front=False)
        if self._drops:
            self._notify()

    def _drop(self, n: int, reason: str) -> None:
        self._dropped += n
        if self.on_drop is not None:
            self._drops.append((n, reason))

    def _notify(self) -> None:
        """Tell ``on_drop`` of the events dropped since the last call (outside the lock: the
        callback may submit). A callback that raises is logged, never raised into the caller."""
        with self._lock:
            drops, self._drops = self._drops, []
        for n, reason in drops:
            try:
                self.on_drop(n, reason)  # type: ignore[misc]  # _drops is only filled with one
            except Exception:
                log.exception("on_drop callback failed")

    def _spool_locked(self, items: list[SpoolItem], *, front: bool) -> bool:
        if self.spool is None or self.spool.closed:
            self._drop(len(items), "Kafka cannot take them and there is no spool")
            return False
        try:
            if front:
                self.spool.prepend(items)
            else:
                self.spool.extend(items)
        except (SpoolError, OSError) as exc:
            self._drop(len(items), f"spool write failed: {exc}")
            self._spool_refused_until = time.monotonic() + self.probe_interval_s
            log.error("spool write failed, %d events dropped: %s", len(items), exc)
            return False
        self._spooled += len(items)
        return True

    @property
    def accepting(self) -> bool:
        """Whether a new event would be kept (handed to Kafka, queued or spooled) rather than
        dropped: False after close, and while events go to a spool that is missing, full
        (``spool_max_bytes``) or failed its last write (for ``probe_interval_s``). A service
        that takes work it records (the proxy) refuses new work while this is False."""
        if self._closed:
            return False
        if not self._to_spool:
            return True
        spool = self.spool
        return (
            spool is not None
            and not spool.closed
            and not spool.full
            and time.monotonic() >= self._spool_refused_until
        )

    def _where(self) -> str:
        return str(self.spool.path) if self.spool is not None else "nowhere (spool disabled)"

    def _backlog(self) -> int:
        return self.spool.backlog if self.spool is not None and not self.spool.closed else 0

    def _unread(self) -> int:
        return self.spool.unread if self.spool is not None and not self.spool.closed else 0

    @property
    def state(self) -> str:
        return CLOSED if self._closed else self._state

    @property
    def stats(self) -> DeliveryStats:
        return DeliveryStats(
            submitted=self._submitted,
            sent=self._sent,
            spooled=self._spooled,
            failed=self._failed,
            dropped=self._dropped,
            deduplicated=self._deduplicated,
            queued=len(self._queue),
            in_flight=len(self._pending),
            spool_backlog=self._backlog(),
            state=self.state,
            accepting=self.accepting,
        )

    def idle(self) -> bool:
        """Nothing waits: queue empty, nothing in flight, spool empty."""
        spooled = self._backlog()
        return not self._queue and not self._pending and not self._failures and not spooled

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait (at most ``timeout``) until everything submitted so far is acknowledged."""
        deadline = time.monotonic() + timeout
        self._wake.set()
        while not self.idle():
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 30.0) -> DeliveryStats:
        """Deliver what can be delivered within ``timeout``, spool the rest, stop the thread."""
        if not self._closing.is_set():
            self._deadline = time.monotonic() + timeout
            self._closing.set()
            self._wake.set()
            atexit.unregister(self._at_exit)
        self._thread.join(timeout + 30.0)
        return self.stats

    # --- delivery thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                if self._step():
                    break
            except Exception:
                log.exception("delivery thread error (continuing)")
                time.sleep(0.05)
        try:
            self._shutdown()
        except Exception:
            log.exception("delivery shutdown error")

    def _step(self) -> bool:
        """One round; True when the thread should stop."""
        self.transport.poll(0)
        now = self._now = time.monotonic()
        if self._acked:
            self._acked = False
            self._last_ok = now
        closing = self._closing.is_set()
        if self.spool is None:  # nowhere to fall back to: the client keeps what it can
            self._drop_failures()
        elif self._state == HEALTHY and (self._failures or self._stalled(now)):
            reason = (
                f"delivery failed: {self._failures[0].item.topic}"
                if self._failures
                else f"nothing acknowledged for {self.degrade_after_s:g}s"
            )
            self._degrade(reason)
        moved = 0
        if self._state == DEGRADED:
            self._settle()
            if not closing and not self._pending and now >= self._next_probe:
                self._probe_and_recover()
        if self._state == HEALTHY:
            moved = self._pump()
        if self.spool is not None:
            self.spool.sync_if_due()
        if self._drops:
            self._notify()
        if closing and (
            now >= self._deadline or self.idle() or (self._state == DEGRADED and not self._pending)
        ):
            return True
        if moved:
            self._active_at = now
            if moved < _BATCH:  # queue drained: let events gather for a linger instead of
                self.transport.poll(_LINGER_S)  # taking the GIL back per event (reports served)
        elif self._pending:
            self.transport.poll(0.005)
        else:
            self._idle_wait(now)
        return False

    def _idle_wait(self, now: float) -> None:
        """Nothing to do. While events keep coming, nap ``_LINGER_S`` and look again, so the
        harness never pays for waking this thread (a wake per event costs more than the whole
        event: every handover of the GIL is a context switch). After ``_NAP_FOR_S`` without
        events, sleep until woken, 50 ms at most: ``submit`` wakes the thread only in that
        state, and only for an event it queued (one it handed to the client itself is sent
        by the client; its delivery report waits for this thread's next look). The flag is
        set BEFORE the queue is checked and read by ``submit`` AFTER its append, so one of
        the two always sees the other: no queued event waits for the timeout."""
        if now - self._active_at < _NAP_FOR_S:
            time.sleep(_LINGER_S)
            return
        self._asleep = True
        try:  # submit hands over (or queues) and THEN reads the flag: one side sees the other
            if not self._queue and not self._pending:
                self._wake.wait(0.05)
        finally:
            self._asleep = False
            self._wake.clear()

    def _stalled(self, now: float) -> bool:
        """Events have waited in the client for ``degrade_after_s`` with no acknowledgement."""
        return (
            bool(self._pending)
            and now - self._last_ok >= self.degrade_after_s
            and now - self._busy_since >= self.degrade_after_s
        )

    def _drop_failures(self) -> None:
        if not self._failures:
            return
        n, self._failures = len(self._failures), []
        self._drop(n, "Kafka did not take them and there is no spool")
        now = time.monotonic()
        if now - self._last_drop_log >= 10.0:
            self._last_drop_log = now
            log.error("%d events dropped: Kafka did not take them and the spool is disabled", n)

    def _degrade(self, reason: str) -> None:
        with self._lock:
            self._state = DEGRADED
            self._to_spool = True
        self._next_probe = time.monotonic() + self.probe_interval_s
        log.warning(
            "Kafka unreachable (%s): spooling events to %s until it answers again "
            "(%d in flight stay with the client)",
            reason,
            self._where(),
            len(self._pending),
        )

    def _settle(self) -> None:
        """When the client holds nothing more: failed deliveries, then events still in memory,
        go in front of the spool (they are older than everything spooled since)."""
        if self._pending or not (self._failures or self._queue):
            return
        failures = self._failures
        with self._lock:  # written first, cleared after: flush() never sees a false "idle"
            self._spool_locked([f.item for f in failures] + list(self._queue), front=True)
            self._queue.clear()
            self._failures = []
        if self.spool is not None and not self.spool.closed:
            for f in failures:
                if f.record is not None:
                    self.spool.ack(f.record)

    def _probe_and_recover(self) -> None:
        ok = self.transport.reachable(self.probe_topic, min(self.probe_interval_s, 5.0) + 1.0)
        self._next_probe = time.monotonic() + self.probe_interval_s
        if not ok:
            return
        if self.spool is not None and self._unread():
            for topic, (since, digests) in self.spool.uncertain().items():
                found = self.transport.delivered(topic, since, digests, 60.0)
                if found is None:
                    log.warning(
                        "could not check %d uncertain spooled events of %s: re-sending them "
                        "(duplicates possible)",
                        len(digests),
                        topic,
                    )
                    continue
                self._known |= found
        backlog = self._backlog()
        self._state = HEALTHY
        self._last_ok = time.monotonic()
        log.warning("Kafka reachable again: delivering %d spooled events in order", backlog)

    def _pump(self) -> int:
        moved = 0
        while moved < _BATCH:
            if self._queue:
                # peek, then pop once handed over: never out of both the queue and the client
                # (flush() would see "idle" in between); only this thread pops
                item = self._queue[0]
                if not self._produce(item.topic, item.key, item.value, item.ts_ms, None):
                    self.transport.poll(0.001)  # the client's buffer is full: serve reports
                    break
                self._queue.popleft()
                moved += 1
                continue
            if self.spool is not None and self._unread():
                records = self.spool.read(max_records=min(500, _BATCH - moved))
                for i, rec in enumerate(records):
                    if rec.uncertain and self._known:
                        digest = record_digest(rec.topic, rec.key, rec.value)
                        if digest in self._known:
                            self._known.discard(digest)
                            self.spool.ack(rec)
                            self._deduplicated += 1
                            continue
                    if not self._produce(rec.topic, rec.key, rec.value, rec.ts_ms, rec):
                        self.spool.rewind(rec)
                        self.transport.poll(0.001)
                        return moved + i
                moved += len(records)
                continue
            with self._lock:
                if self._to_spool and not self._queue and not self._unread():
                    self._to_spool = False
                    self._known.clear()
                    log.info("spool drained: events go straight to Kafka again")
            break
        return moved

    def _produce(
        self, topic: str, key: bytes, value: bytes, ts_ms: int, record: SpoolRecord | None
    ) -> bool:
        """Hand one message to the client; False when its buffer is full (try again later).
        Never blocks: ``submit`` calls it from the harness's thread (holding the lock)."""
        n = next(self._numbers)
        report = functools.partial(self._report, n, topic, key, value, ts_ms, record)
        if not self._pending:
            self._busy_since = self._now
        self._pending[n] = report  # before the hand-over: flush() always sees it somewhere
        try:
            self.transport.produce(topic, key, value, report, timestamp_ms=ts_ms)
        except BufferError:
            del self._pending[n]
            return False
        except Exception as exc:  # rejected outright (bad argument, too large): for good
            if self._pending.pop(n, None) is not None:
                item = SpoolItem(topic, key, value, ts_ms)
                self._reject(item, record, f"{type(exc).__name__}: {exc}")
        return True

    def _on_report(
        self,
        n: int,
        topic: str,
        key: bytes,
        value: bytes,
        ts_ms: int,
        record: SpoolRecord | None,
        err: object,
        _msg: object,
    ) -> None:
        """The client's delivery report of message ``n`` (``record``: where it came from in
        the spool); ``err`` is the client's error, None when acknowledged."""
        if n not in self._pending:
            return  # settled already: the close path gave up waiting for this report
        try:
            if err is None:
                self._sent += 1
                self._acked = True
                if record is not None and self.spool is not None:
                    self.spool.ack(record)
            else:
                item = SpoolItem(topic, key, value, ts_ms)
                self._settle_failure(item, record, self.transport.describe(err))
        finally:
            del self._pending[n]  # after it is counted or queued for the spool

    def _settle_failure(
        self, item: SpoolItem, record: SpoolRecord | None, err: DeliveryError
    ) -> None:
        if err.permanent:
            self._reject(item, record, f"{err.code}: {err.message}")
        else:
            item = SpoolItem(item.topic, item.key, item.value, item.ts_ms, uncertain=True)
            self._failures.append(_Failure(item, record))

    def _reject(self, item: SpoolItem, record: SpoolRecord | None, reason: str) -> None:
        self._failed += 1
        log.error(
            "Kafka rejected an event for good (topic %s, key %r, %d bytes): %s",
            item.topic,
            item.key[:64],
            len(item.value),
            reason,
        )
        if record is not None and self.spool is not None:
            self.spool.ack(record)

    def _shutdown(self) -> None:
        """Closing: wait for the client until the deadline, purge it, spool what is left."""
        with self._lock:
            self._to_spool = True  # from now on new events go behind everything spooled
        remaining = max(0.0, self._deadline - time.monotonic())
        if self._pending:
            self.transport.flush(remaining)
        if self._pending:
            self.transport.purge()  # every purged message gets a failure report: spooled
            until = time.monotonic() + 10.0
            while self._pending and time.monotonic() < until:
                self.transport.poll(0.05)
            if self._pending:  # the client never answered: treat them as failed (uncertain)
                unanswered = DeliveryError("_UNANSWERED", "no report after purge")
                for report in list(self._pending.values()):
                    _, topic, key, value, ts_ms, record = report.args
                    item = SpoolItem(topic, key, value, ts_ms)
                    self._settle_failure(item, record, unanswered)
                self._pending.clear()
        self._settle()
        with self._lock:
            self._closed = True
        if self.spool is not None:
            backlog = self.spool.backlog
            self.spool.close()
            if backlog:
                log.warning(
                    "closed with %d events spooled in %s: the next recorder sends them",
                    backlog,
                    self.spool.path,
                )
        self.transport.close()


def _close_at_exit(ref: weakref.ref[Delivery], timeout: float) -> None:
    delivery = ref()
    if delivery is not None and not delivery._closing.is_set():
        delivery.close(timeout)
