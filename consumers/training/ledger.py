"""The trainer's ledger writer: the ``TrainStep`` records of committed steps (schemas/steps.py)
on ``<ns>.trainer.steps``, spooled to ``<checkpoint_dir>/train-steps/step-N.jsonl`` before the
step's checkpoint is committed and sent after its PolicyVersion without waiting; a step's file
goes once every part is acknowledged. A refused or unacknowledged send is logged and tried
again after the next step and at the next start, so the ledger never holds up or fails a step
(at least once: readers fold by coordinates). trainer.py's docstring tells the whole order.

A drop-only commit over step N (``CheckpointStore.commit_drops``, the k-th over that step) is
spooled as ``step-N-drop-k.jsonl``: records of step N listing the records it dropped. Files
are keyed and sent in (step, k) order; a start forgets those past the committed (step, k).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from rollstream.consumers.training.dataset import close_producer
from rollstream.schemas import TrainStep

__all__ = ["StepLedger"]

log = logging.getLogger("rollstream.trainer")

_SPOOLED = re.compile(r"^step-(\d+)(?:-drop-(\d+))?$")
Key = tuple[int, int]  # (step, drop-only commit over it: 0 for the step itself)


def _name(key: Key) -> str:
    step, drop = key
    return f"step {step}" if drop == 0 else f"step {step} (drop-only commit {drop})"


class StepLedger:
    """TrainStep records of committed steps (trainer.py's docstring): spooled, then sent without
    waiting; a step's file goes once every part is acknowledged. At most ``MAX_SPOOL`` files
    are kept (the oldest are dropped, logged) when the topic refuses them for that long."""

    MAX_SPOOL = 10_000

    def __init__(self, root: Path, topic: str, kafka: dict[str, str], *, fsync: bool) -> None:
        self.dir, self.topic, self.fsync = root / "train-steps", topic, fsync
        self.dir.mkdir(parents=True, exist_ok=True)
        self.producer = Producer({**kafka, "enable.idempotence": True, "acks": "all"})
        self.in_flight: dict[Key, int] = {}  # (step, drop) -> parts not acknowledged yet
        self.failed: set[Key] = set()  # with a part refused: sent again

    def _files(self) -> dict[Key, Path]:
        found = ((p, _SPOOLED.match(p.stem)) for p in self.dir.glob("step-*.jsonl"))
        return {(int(m[1]), int(m[2] or 0)): p for p, m in found if m}

    def forget_after(self, step: int, drops: int = 0) -> None:
        """Remove the files past ``step`` and its ``drops`` drop-only commits (written, never
        committed)."""
        for key, path in self._files().items():
            if key > (step, drops):
                path.unlink(missing_ok=True)

    def pending(self) -> list[str]:
        """The spooled steps not acknowledged yet, oldest first (for the log)."""
        return [_name(key) for key in sorted(self._files())]

    def spool(self, step: int, records: list[TrainStep], drop: int = 0) -> None:
        """Write the records of ``step`` (``drop`` > 0: of its drop-only commit ``drop``)."""
        path = self.dir / (f"step-{step:08d}" + (f"-drop-{drop}" if drop else "") + ".jsonl")
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
        for key, old in files[: max(0, len(files) - self.MAX_SPOOL)]:
            log.error("ledger: %s never acknowledged by %s; dropped", _name(key), self.topic)
            old.unlink(missing_ok=True)

    def _delivered(self, key: Key, path: Path) -> Callable[[KafkaError | None, Message], None]:
        def done(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                self.failed.add(key)
            self.in_flight[key] -= 1
            if self.in_flight[key] == 0:
                del self.in_flight[key]
                if key in self.failed:
                    log.warning(
                        "ledger: %s not acknowledged by %s: %s (sent again after the next step)",
                        _name(key),
                        self.topic,
                        err,
                    )
                else:
                    path.unlink(missing_ok=True)

        return done

    def send(self) -> None:
        """Send every spooled step not in flight, oldest first; never raises."""
        self.producer.poll(0)
        for key, path in sorted(self._files().items()):
            if key in self.in_flight:
                continue
            self.failed.discard(key)
            lines = path.read_bytes().splitlines()
            self.in_flight[key] = len(lines)
            for n, line in enumerate(lines):
                try:
                    done = self._delivered(key, path)
                    self.producer.produce(self.topic, line, str(key[0]).encode(), on_delivery=done)
                except (BufferError, KafkaException) as exc:
                    log.warning("ledger: %s not sent to %s: %s", _name(key), self.topic, exc)
                    self.in_flight[key] -= len(lines) - n
                    if self.in_flight[key] <= 0:
                        del self.in_flight[key]
                    else:
                        self.failed.add(key)
                    return

    def close(self, timeout: float) -> None:
        """Send what is spooled and wait up to ``timeout`` s; the rest stays for the next start
        (logged)."""
        self.send()
        close_producer(self.producer, timeout)
        left = self.pending()
        if left:
            log.warning(
                "ledger: %s not acknowledged by %s in %.1f s (sent at the next start)",
                ", ".join(left[:10]),
                self.topic,
                timeout,
            )
