"""The stream processor as a subprocess (``rollstream process``, so tests can SIGKILL it) and a
background reader of a topic: shared by the processor's integration tests."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _logged_process import LoggedProcess
from confluent_kafka import Consumer

from rollstream.schemas import Codec, CommonSettings, Sample

codec = Codec()
GROUP_TIMEOUT_S = 3.0


class Worker(LoggedProcess):
    """``rollstream process`` as a subprocess (so it can be SIGKILLed)."""

    def __init__(self, settings: CommonSettings, tmp_path: Path, **env: str) -> None:
        super().__init__(
            ["process"], settings, tmp_path, "worker.log",
            {
                "ROLLSTREAM_PROC_GROUP_TIMEOUT_S": str(GROUP_TIMEOUT_S),
                "ROLLSTREAM_PROC_TIMER_INTERVAL_S": "0.5",
                "ROLLSTREAM_PROC_STATS_INTERVAL_S": "5",
                **{f"ROLLSTREAM_PROC_{k.upper()}": v for k, v in env.items()},
            },
        )  # fmt: skip

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until the worker started last logs that it is ready (its tables rebuilt)."""
        deadline = time.monotonic() + timeout
        while "Worker ready" not in self.current_log():
            assert self.proc is not None and self.proc.poll() is None, self.log_tail()
            assert time.monotonic() < deadline, self.log_tail()
            time.sleep(0.1)


class Reader:
    """Reads a topic from the beginning in a background thread."""

    def __init__(self, settings: CommonSettings, topic: str) -> None:
        self.records: list[Any] = []
        self._stop = threading.Event()
        self._consumer = Consumer(
            {
                **settings.kafka_config(),
                "group.id": f"it-{uuid.uuid4().hex}",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
            }
        )
        self._consumer.subscribe([topic])
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for msg in self._consumer.consume(500, 0.2):
                if not msg.error():
                    self.records.append(msg)

    def wait(self, done: Any, timeout: float, worker: Worker | None = None) -> None:
        deadline = time.monotonic() + timeout
        while not done(self.records):
            if time.monotonic() > deadline:
                tail = worker.log_tail() if worker is not None else ""
                raise AssertionError(f"timed out with {len(self.records)} records\n{tail}")
            time.sleep(0.1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._consumer.close()


@contextlib.contextmanager
def reading(settings: CommonSettings, topic: str) -> Iterator[Reader]:
    reader = Reader(settings, topic)
    try:
        yield reader
    finally:
        reader.close()


def sample_ids(records: list[Any]) -> set[str]:
    return {codec.decode(m.value(), expect=Sample).sample_id for m in records}
