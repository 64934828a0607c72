"""``rollstream report`` (consumers/analytics/report_cli.run) against the analytics server of a
running sink, then against the chDB store itself once the sink has stopped: canned views, --sql,
--plot, and a write statement refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _sink_process import Committed, SinkProcess, ends_of, record_rollouts, wait_committed
from rich.console import Console

from rollstream.consumers.analytics import reports
from rollstream.consumers.analytics.report_cli import ReportError, ReportSettings, run
from rollstream.consumers.errors import RefusedQuery
from rollstream.schemas import CommonSettings

pytestmark = pytest.mark.integration


@pytest.fixture
def sink(kafka_settings: CommonSettings, tmp_path: Path) -> Iterator[SinkProcess]:
    s = SinkProcess(kafka_settings, tmp_path)
    s.start()
    s.wait_ready()
    record_rollouts(kafka_settings, tmp_path, 8, seed=1, policy_version=3)
    committed = Committed(kafka_settings)
    try:
        wait_committed(committed, ends_of(kafka_settings, [kafka_settings.topics().events]), s, 60)
    finally:
        committed.close()
    yield s
    s.stop()


def console() -> Console:
    return Console(record=True, width=240)


def test_report_views_sql_and_plot_through_the_sink(
    kafka_settings: CommonSettings, tmp_path: Path, sink: SinkProcess
) -> None:
    settings = ReportSettings(namespace=kafka_settings.namespace, analytics_url=sink.url)

    out = console()
    shown = run(settings, view="rollouts_by_status", console=out)
    assert shown["rollouts_by_status"].rows == [("completed", 8, 1.0)]
    text = out.export_text()
    assert "rollouts_by_status" in text and "completed" in text

    out = console()
    shown = run(settings, view="reward_by_policy", plot=tmp_path / "reward.png", console=out)
    (row,) = shown["reward_by_policy"].rows
    assert row[:2] == (3, 8)  # policy version 3, 8 rollouts (rewards 0/1 alternate)
    assert row[2] == pytest.approx(0.5)
    assert (tmp_path / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot written" in out.export_text()

    out = console()
    shown = run(
        settings,
        sql="SELECT type, count() AS n FROM events WHERE type != {skip:String} "
        "GROUP BY type ORDER BY type",
        params={"skip": "Branch"},
        console=out,
    )
    table = shown["sql"]
    assert table.columns == ("type", "n")
    assert dict(table.rows) == {
        "LlmCall": 16, "Reward": 8, "RolloutError": 8, "RolloutFinished": 8,
        "RolloutStarted": 8, "ToolCall": 8,
    }  # fmt: skip
    assert "RolloutStarted" in out.export_text()

    shown = run(settings, console=console())  # every view
    assert set(shown) == set(reports.VIEWS)

    for statement in ("DROP TABLE events", "INSERT INTO events SELECT * FROM events",
                      "SELECT 1; TRUNCATE TABLE events"):  # fmt: skip
        with pytest.raises(RefusedQuery):
            run(settings, sql=statement, console=console())
    with pytest.raises(ReportError, match="no chart"):
        run(settings, view="pass_at_k", plot=tmp_path / "x.png", console=console())
    with pytest.raises(ReportError, match="no view"):
        run(settings, view="nope", console=console())

    # the store itself, once no sink holds the path (chDB: one process per path)
    sink.stop()
    direct = f"chdb://{sink.chdb_path}"
    shown = run(settings, view="rollouts_by_status", url=direct, console=console())
    assert shown["rollouts_by_status"].rows == [("completed", 8, 1.0)]
    with pytest.raises(RefusedQuery):
        run(settings, sql="DROP TABLE events", url=direct, console=console())
