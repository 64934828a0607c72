"""The trainer's ledger writer: the ``TrainStep`` records of committed steps (schemas/steps.py)
on ``<ns>.trainer.steps``, spooled to ``<checkpoint_dir>/train-steps/step-N.jsonl`` before the
step's checkpoint is committed and sent after its PolicyVersion without waiting; a step's file
goes once every part is acknowledged. A refused or unacknowledged send is logged and tried
again after the next step and at the next start, so the ledger never holds up or fails a step
(at least once: readers fold by coordinates). trainer.py's docstring tells the whole order.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from rollstream.consumers.training.dataset import close_producer
from rollstream.schemas import TrainStep

__all__ = ["StepLedger"]

log = logging.getLogger("rollstream.trainer")


class StepLedger:
    """TrainStep records of committed steps (trainer.py's docstring): spooled, then sent without
    waiting; a step's file goes once every part is acknowledged. At most ``MAX_SPOOL`` files
    are kept (the oldest are dropped, logged) when the topic refuses them for that long."""

    MAX_SPOOL = 10_000

    def __init__(self, root: Path, topic: str, kafka: dict[str, str], *, fsync: bool) -> None:
        self.dir, self.topic, self.fsync = root / "train-steps", topic, fsync
        self.dir.mkdir(parents=True, exist_ok=True)
        self.producer = Producer({**kafka, "enable.idempotence": True, "acks": "all"})
        self.in_flight: dict[int, int] = {}  # step -> parts not acknowledged yet
        self.failed: set[int] = set()  # steps with a part refused: sent again

    def _files(self) -> dict[int, Path]:
        found = ((p, p.stem.removeprefix("step-")) for p in self.dir.glob("step-*.jsonl"))
        return {int(n): p for p, n in found if n.isdigit()}

    def forget_after(self, step: int) -> None:
        """Remove the files of steps past ``step`` (written, never committed)."""
        for n, path in self._files().items():
            if n > step:
                path.unlink(missing_ok=True)

    def spool(self, step: int, records: list[TrainStep]) -> None:
        path = self.dir / f"step-{step:08d}.jsonl"
        tmp = path.with_suffix(".tmp")
        with tmp.open("wb") as f:
            f.writelines(r.encode() + b"\n" for r in records)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if self.fsync:
            fd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        files = sorted(self._files().items())
        for n, old in files[: max(0, len(files) - self.MAX_SPOOL)]:
            log.error("ledger: step %d never acknowledged by %s; dropped", n, self.topic)
            old.unlink(missing_ok=True)

    def _delivered(self, step: int, path: Path) -> Callable[[KafkaError | None, Message], None]:
        def done(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                self.failed.add(step)
            self.in_flight[step] -= 1
            if self.in_flight[step] == 0:
                del self.in_flight[step]
                if step in self.failed:
                    log.warning("ledger: step %d not acknowledged by %s: %s (sent again "
                                "after the next step)", step, self.topic, err)  # fmt: skip
                else:
                    path.unlink(missing_ok=True)

        return done

    def send(self) -> None:
        """Send every spooled step not in flight, oldest first; never raises."""
        self.producer.poll(0)
        for step, path in sorted(self._files().items()):
            if step in self.in_flight:
                continue
            self.failed.discard(step)
            lines = path.read_bytes().splitlines()
            self.in_flight[step] = len(lines)
            for n, line in enumerate(lines):
                try:
                    self.producer.produce(self.topic, line, str(step).encode(),
                                          on_delivery=self._delivered(step, path))  # fmt: skip
                except (BufferError, KafkaException) as exc:
                    log.warning("ledger: step %d not sent to %s: %s", step, self.topic, exc)
                    self.in_flight[step] -= len(lines) - n
                    if self.in_flight[step] <= 0:
                        del self.in_flight[step]
                    else:
                        self.failed.add(step)
                    return

    def close(self, timeout: float) -> None:
        """Send what is spooled and wait up to ``timeout`` s; the rest stays for the next start."""
        self.send()
        close_producer(self.producer, timeout)
