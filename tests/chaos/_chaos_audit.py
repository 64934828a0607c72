"""What the chaos run checks at its end, over what it read back (the events, trajectories and
samples topics, the sink's ClickHouse rows, the trainer's manifests): plain functions over
decoded records, no I/O. An anomaly is charged to the kill in whose window it happened: the
last kill at or before the event's time (``ts``), or ``-`` before the first kill."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from _chaos_stack import Kill

from rollstream.consumers.training.checkpoint import Manifest
from rollstream.schemas import Event, RolloutFinished, RolloutStarted, Sample, Trajectory

__all__ = [
    "Audit",
    "Located",
    "audit_events",
    "audit_samples",
    "audit_trajectories",
    "table",
    "window_of",
]

Located = tuple[int, int]  # (partition, offset)
CLOSED = {"completed", "failed", "timeout", "aborted", "truncated"}


@dataclass
class Audit:
    """Counts per component (``lost``, ``duplicated``: Kafka and ClickHouse together) and the
    findings as lines, each naming what and where."""

    lost: Counter[str] = field(default_factory=Counter)
    duplicated: Counter[str] = field(default_factory=Counter)
    findings: list[str] = field(default_factory=list)
    figures: dict[str, int] = field(default_factory=dict)

    def charge(self, kind: str, kills: Sequence[Kill], ts_us: int, n: int, what: str) -> None:
        who = window_of(kills, ts_us / 1e6)
        (self.lost if kind == "lost" else self.duplicated)[who] += n
        self.findings.append(f"{kind} x{n} [{who}]: {what}")


def window_of(kills: Sequence[Kill], t: float) -> str:
    """The part killed last at or before ``t`` (seconds since the epoch), ``-`` before any."""
    before = [k for k in kills if k.killed_at <= t]
    return before[-1].component if before else "-"


def audit_events(
    audit: Audit,
    kills: Sequence[Kill],
    events: Sequence[tuple[Located, Event]],
    stored: Sequence[tuple[str, str, int]],
    stored_rows: int,
) -> None:
    """Kafka: each event_id once, each rollout's seqs 0..last once each with no gap; ClickHouse
    (``stored``: (event_id, rollout_id, seq) of ``events FINAL``, ``stored_rows`` its row
    count): each event of the topic once."""
    by_id: dict[str, list[Event]] = defaultdict(list)
    by_rollout: dict[str, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    for _, e in events:
        by_id[e.event_id].append(e)
        by_rollout[e.rollout_id][e.seq].add(e.event_id)
    ts_of = {eid: evs[0].ts for eid, evs in by_id.items()}
    for eid, evs in by_id.items():
        if len(evs) > 1:
            audit.charge(
                "duplicated",
                kills,
                evs[0].ts,
                len(evs) - 1,
                f"kafka: event {eid} ({evs[0].rollout_id} seq {evs[0].seq}, "
                f"{evs[0].kind}) {len(evs)} times",
            )
    for rid, seqs in by_rollout.items():
        for seq, ids in seqs.items():
            if len(ids) > 1:
                ts = min(ts_of[i] for i in ids)
                audit.charge(
                    "duplicated",
                    kills,
                    ts,
                    len(ids) - 1,
                    f"kafka: {rid} seq {seq} carried by {len(ids)} event ids",
                )
        missing = sorted(set(range(max(seqs) + 1)) - set(seqs))
        if missing:
            after = min((s for s in seqs if s > missing[0]), default=max(seqs))
            ts = ts_of[next(iter(seqs[after]))]
            audit.charge("lost", kills, ts, len(missing), f"kafka: {rid} seqs {missing} missing")
    audit.figures["kafka events"] = len(by_id)
    audit.figures["kafka records"] = len(events)
    audit.figures["rollouts"] = len(by_rollout)

    stored_ids = Counter(eid for eid, _, _ in stored)
    audit.figures["clickhouse rows (raw)"] = stored_rows
    audit.figures["clickhouse rows (FINAL)"] = len(stored)
    for eid in sorted(set(by_id) - set(stored_ids)):
        e = by_id[eid][0]
        audit.charge(
            "lost",
            kills,
            e.ts,
            1,
            f"clickhouse: event {eid} ({e.rollout_id} seq {e.seq}, {e.kind}) not stored",
        )
    for eid, n in stored_ids.items():
        if n > 1:
            audit.charge(
                "duplicated",
                kills,
                ts_of.get(eid, 0),
                n - 1,
                f"clickhouse: event {eid} {n} rows after FINAL",
            )
    for eid in sorted(set(stored_ids) - set(by_id)):
        audit.findings.append(f"clickhouse: event {eid} stored but not on the topic")


def audit_trajectories(
    audit: Audit, events: Iterable[tuple[Located, Event]], trajectories: Iterable[Trajectory]
) -> None:
    """Every rollout that started has a trajectory whose status is a closed one; a rollout
    that is not completed carries its reason (its error, or the status truncated)."""
    started = {e.rollout_id for _, e in events if isinstance(e.body, RolloutStarted)}
    finished = {e.rollout_id for _, e in events if isinstance(e.body, RolloutFinished)}
    last: dict[str, Trajectory] = {}
    for t in trajectories:
        last[t.rollout_id] = t  # offset order: the last record of a rollout wins
    statuses = Counter(t.status for t in last.values())
    audit.figures.update({f"trajectories {k}": v for k, v in sorted(statuses.items())})
    for rid in sorted(started - set(last)):
        audit.findings.append(f"trajectory: {rid} started and has no trajectory")
    for rid, t in sorted(last.items()):
        if t.status not in CLOSED:
            audit.findings.append(f"trajectory: {rid} status {t.status!r} is not closed")
        elif t.status not in ("completed", "truncated") and not t.error:
            audit.findings.append(f"trajectory: {rid} {t.status} without a reason")
    audit.figures["rollouts without RolloutFinished"] = len(started - finished)


def audit_samples(
    audit: Audit, samples: Sequence[tuple[Located, Sample]], manifests: Sequence[Manifest]
) -> None:
    """Every sample record is in exactly one committed step's manifest (trained, stale, dlq,
    duplicate or skipped); no sample_id trained twice; each sample_id trained or dropped."""
    trained_ids = Counter(i for m in manifests for i in m.trained_ids)
    for sid, n in trained_ids.items():
        if n > 1:
            audit.findings.append(f"samples: {sid} trained {n} times")
    audit.figures["samples trained twice"] = sum(1 for n in trained_ids.values() if n > 1)
    where: dict[Located, list[str]] = defaultdict(list)
    for m in manifests:
        for kind in ("trained", "stale", "dlq", "duplicate", "skipped"):
            for loc in getattr(m, kind):
                where[loc].append(kind)
    reasons: Counter[str] = Counter()
    sample_fate: dict[str, set[str]] = defaultdict(set)
    for loc, s in samples:
        kinds = where.get(loc, [])
        if len(kinds) != 1:
            audit.findings.append(f"samples: record {loc} ({s.sample_id}) in manifests {kinds}")
        for k in kinds:
            reasons[k] += 1
            sample_fate[s.sample_id].add(k)
    for sid, fate in sorted(sample_fate.items()):
        if fate == {"duplicate"} and sid not in trained_ids:
            audit.findings.append(f"samples: {sid} dropped as a duplicate, never trained")
    audit.figures["sample records"] = len(samples)
    audit.figures["sample ids"] = len({s.sample_id for _, s in samples})
    audit.figures.update({f"sample records {k}": v for k, v in sorted(reasons.items())})


def table(audit: Audit, kills: Sequence[Kill], components: Sequence[str]) -> str:
    """component | kills survived | events lost | duplicated (markdown)."""
    survived = Counter(k.component for k in kills if k.back_at is not None)
    rows = [
        "| component | kills survived | events lost | duplicated |",
        "| --- | ---: | ---: | ---: |",
    ]
    for c in ["-", *components]:
        if c == "-" and not (audit.lost["-"] or audit.duplicated["-"]):
            continue
        label = "(before any kill)" if c == "-" else c
        rows.append(f"| {label} | {survived[c]} | {audit.lost[c]} | {audit.duplicated[c]} |")
    total_l, total_d = sum(audit.lost.values()), sum(audit.duplicated.values())
    rows.append(f"| all | {sum(survived.values())} | {total_l} | {total_d} |")
    return "\n".join(rows)
