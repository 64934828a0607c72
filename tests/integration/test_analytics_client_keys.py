"""The analytics server's clients send the analyst key: ``AnalyticsClient(api_key=)``,
``rollstream report`` (``ReportSettings.analytics_api_key``) and ``rollstream replay --source
clickhouse`` (``ReplaySettings.analytics_api_key``) against a server started with keys, on real
chDB (``serve`` in this process) and, for the replay, the real broker. With the key: 200 and the
data; without it or with a wrong one: 401, never the data."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _kafka_read import read_topic
from pydantic import SecretStr
from rich.console import Console

from rollstream.consumers.analytics.client import AnalyticsClient
from rollstream.consumers.analytics.replay import ReplaySettings
from rollstream.consumers.analytics.replay import run as replay
from rollstream.consumers.analytics.report_cli import ReportSettings
from rollstream.consumers.analytics.report_cli import run as report
from rollstream.consumers.analytics.server import AnalyticsServer, serve
from rollstream.consumers.analytics.settings import AnalyticsSettings
from rollstream.consumers.errors import AnalyticsHTTPError
from rollstream.consumers.store.chstore import connect, insert_batch
from rollstream.consumers.store.migrations import apply_migrations
from rollstream.consumers.store.rows import RowBatch
from rollstream.schemas import Codec, CommonSettings, Event, Reward, RolloutFinished, RolloutStarted

pytestmark = pytest.mark.integration

KEY = "analyst-key-for-clients"
NAMESPACE = "ak1"
T0 = 1_735_689_600_000_000
codec = Codec()


def _events() -> list[Event]:
    """Three rollouts of three events each (start, reward, finish)."""
    out = []
    for i in range(3):
        rid = f"ak-r{i}"
        bodies = [RolloutStarted(f"task-{i}", "g"), Reward(float(i)), RolloutFinished("completed")]
        out += [Event(f"{rid}e{seq}", rid, seq, T0 + i, b) for seq, b in enumerate(bodies)]
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AnalyticsServer]:
    path: Path = tmp_path_factory.mktemp("chdb-keys")
    settings = AnalyticsSettings(
        clickhouse_url=f"chdb://{path}",
        namespace=NAMESPACE,
        analytics_port=0,
        analytics_api_keys=f"{KEY},second-key",
    )
    writer = connect(settings.clickhouse_url)
    apply_migrations(writer, settings.database)
    batch = RowBatch("rollout.events", 0)
    for offset, event in enumerate(_events()):
        batch.add(event, offset)
    insert_batch(writer, batch.tables, batch.token, database=settings.database)
    srv = serve(settings)
    yield srv
    srv.stop()
    writer.close()


def test_the_client_sends_its_key(server: AnalyticsServer) -> None:
    for key in (KEY, SecretStr(KEY), "second-key"):
        with AnalyticsClient(server.url, api_key=key) as client:
            health = client.health()  # the full answer, only with a key
            assert health["namespace"] == NAMESPACE and health["database"] == "rollstream_ak1"
            table = client.query(
                "SELECT count() FROM events WHERE type = {t:String}", {"t": "Reward"}
            )
            assert table.rows == [(3,)]
            assert client.count(NAMESPACE, {}) == (3, 9)
            pages = list(client.events(NAMESPACE, {}))
            assert sum(len(page) for page in pages) == 2 * 9  # (key, value) per event
            rows = client.report("rollouts_by_status", namespace=NAMESPACE).rows
            assert rows == [("completed", 3, 1.0)]

    wrong: tuple[SecretStr | str | None, ...] = (None, "", "wrong-key", SecretStr("wrong-key"))
    for bad in wrong:
        with AnalyticsClient(server.url, api_key=bad) as client:
            assert client.health() == {"service": "rollstream-analytics", "auth": "required"}
            calls = (
                lambda c: c.query("SELECT 1"),
                lambda c: c.views(),
                lambda c: c.report("rollouts_by_status"),
                lambda c: c.count(NAMESPACE, {}),
                lambda c: c.event_page(NAMESPACE, {}, None, 10),
            )
            for call in calls:
                with pytest.raises(AnalyticsHTTPError, match="API key") as err:
                    call(client)
                assert err.value.status == 401


def test_report_sends_analytics_api_key(
    server: AnalyticsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    keyed = ReportSettings(namespace=NAMESPACE, analytics_url=server.url, analytics_api_key=KEY)
    out = Console(record=True, width=200)
    shown = report(keyed, view="rollouts_by_status", console=out)
    assert shown["rollouts_by_status"].rows == [("completed", 3, 1.0)]
    assert "rollouts_by_status" in out.export_text()
    shown = report(keyed, sql="SELECT max(value) AS top FROM rewards", console=out)
    assert shown["sql"].rows == [(2.0,)]
    assert KEY not in out.export_text() and KEY not in repr(keyed)

    monkeypatch.setenv("ROLLSTREAM_ANALYTICS_API_KEY", KEY)  # as `rollstream report` reads it
    from_env = ReportSettings(namespace=NAMESPACE, analytics_url=server.url)
    assert from_env.analytics_api_key is not None
    assert report(from_env, view="rollouts_by_status", console=out)["rollouts_by_status"].rows
    monkeypatch.delenv("ROLLSTREAM_ANALYTICS_API_KEY")

    keyless = ReportSettings(namespace=NAMESPACE, analytics_url=server.url)
    with pytest.raises(AnalyticsHTTPError) as err:
        report(keyless, view="rollouts_by_status", console=out)
    assert err.value.status == 401


def test_replay_from_clickhouse_sends_analytics_api_key(
    server: AnalyticsServer, kafka_settings: CommonSettings
) -> None:
    def settings(target: str, key: str | None) -> ReplaySettings:
        return ReplaySettings(
            kafka_bootstrap=kafka_settings.kafka_bootstrap,
            namespace=NAMESPACE,
            replay_to=target,
            replay_source="clickhouse",
            replay_progress=False,
            analytics_url=server.url,
            analytics_api_key=key,
        )

    target = f"{kafka_settings.namespace}k"
    result = replay(settings(target, KEY))
    assert (result.published, result.rollouts_selected) == (9, 3)
    messages = read_topic(kafka_settings, f"{target}.rollout.events")
    got = {(m.key(), codec.decode(m.value(), expect=Event).seq): m.value() for m in messages}
    want = {(e.rollout_id.encode(), e.seq): codec.encode(e) for e in _events()}
    assert got == want  # the very events stored, byte for byte

    with pytest.raises(AnalyticsHTTPError) as err:
        replay(settings(f"{kafka_settings.namespace}n", None))
    assert err.value.status == 401
