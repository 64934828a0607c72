"""Who holds each rollout's sandbox between stages: one claim file per rollout under a directory
every worker of this host shares (``<home>/claims``; on a shared filesystem for workers on
several hosts).

``<dir>/<rollout_id>.json`` holds ``{sandbox_id, kind, stage, holder, released, message}``:

- held (``released`` false): ``holder`` (host:pid:start:boot of the worker process) works in the
  sandbox at ``stage``; ``message`` is the stage message it works on;
- released: the worker of ``stage`` handed the rollout on; ``message`` is the next stage's
  message, so a redelivered message can send it again (stages.judge's ``resend``).

Every read-judge-write happens under an exclusive ``flock`` of ``<dir>/<rollout_id>.lock``, so
two workers given the same message (a rebalance) never both take it. ``sweep`` finds claims held
by dead workers. The rules are stages.judge's; this module is the file I/O.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rollstream.producers.rollouts.sandbox import SandboxOwner
from rollstream.producers.rollouts.stages import STAGES, Claim, StageName

__all__ = ["ClaimFile", "ClaimStore", "holder_id"]

_NAME = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")


def holder_id(owner: SandboxOwner | None = None) -> str:
    """This process (or ``owner``) as a claim holder: ``host:pid:start:boot``."""
    o = owner or SandboxOwner.current()
    return f"{o.host}:{o.pid}:{o.start}:{o.boot_id}"


def _alive(holder: str) -> bool:
    host, pid, start, boot = [*holder.split(":", 3), "", "", "", ""][:4]
    try:
        return SandboxOwner(host, int(pid), int(start), boot).alive()
    except ValueError:
        return False  # not a holder this code wrote


@dataclass(frozen=True, slots=True)
class ClaimFile:
    """One rollout's claim as stored."""

    rollout_id: str
    sandbox_id: str
    kind: str
    stage: StageName
    holder: str
    released: bool
    message: bytes

    def claim(self) -> Claim:
        alive = bool(self.holder) and _alive(self.holder)
        return Claim(self.stage, self.holder, self.released, alive)


class ClaimStore:
    """The claim files under ``root``."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, rollout_id: str, suffix: str) -> Path:
        if not _NAME.match(rollout_id):
            raise ValueError(f"rollout id {rollout_id!r}")
        return self.root / f"{rollout_id}{suffix}"

    @contextlib.contextmanager
    def locked(self, rollout_id: str) -> Iterator[None]:
        """Hold the rollout's lock (other processes wait) for a read-judge-write."""
        fd = os.open(self._path(rollout_id, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def read(self, rollout_id: str) -> ClaimFile | None:
        try:
            data = json.loads(self._path(rollout_id, ".json").read_text())
            stage = data["stage"]
            if stage not in STAGES:
                return None
            return ClaimFile(
                rollout_id=rollout_id,
                sandbox_id=str(data["sandbox_id"]),
                kind=str(data["kind"]),
                stage=stage,
                holder=str(data["holder"]),
                released=bool(data["released"]),
                message=str(data["message"]).encode(),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, claim: ClaimFile) -> None:
        path = self._path(claim.rollout_id, ".json")
        tmp = path.with_suffix(".json.tmp")
        body = {
            "sandbox_id": claim.sandbox_id,
            "kind": claim.kind,
            "stage": claim.stage,
            "holder": claim.holder,
            "released": claim.released,
            "message": claim.message.decode(),
        }
        tmp.write_text(json.dumps(body))
        os.replace(tmp, path)  # atomic: a reader sees the old claim or the new one

    def remove(self, rollout_id: str) -> None:
        for suffix in (".json", ".lock"):
            with contextlib.suppress(FileNotFoundError):
                self._path(rollout_id, suffix).unlink()

    def rollout_ids(self) -> list[str]:
        return sorted(p.stem for p in self.root.glob("*.json"))

    def sandbox_ids(self) -> set[str]:
        """The sandboxes some claim names (the sweep leaves those to the claims' rules)."""
        out = set()
        for rid in self.rollout_ids():
            claim = self.read(rid)
            if claim is not None:
                out.add(claim.sandbox_id)
        return out
