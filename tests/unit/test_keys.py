"""The home's key file (``<home>/keys.json``) and the key settings it fills: made once with mode
0600 and never overwritten, refused when group or others may read it, read back by every
settings class that has a key setting left unset; a value set by hand wins, and
``ROLLSTREAM_INSECURE`` leaves every one unset. Real files in a temporary home."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from rollstream.consumers.analytics.report_cli import ReportSettings
from rollstream.consumers.analytics.service import SinkServiceSettings
from rollstream.consumers.control.controller import ControlSettings
from rollstream.inference.settings import ModelServerSettings
from rollstream.infra.cli import KEY_ROLES
from rollstream.infra.keys import create_keys, key_path, read_keys
from rollstream.infra.stack import StackSettings
from rollstream.producers.proxy.settings import ProxySettings
from rollstream.producers.rollouts.settings import RolloutSettings
from rollstream.schemas import CommonSettings
from rollstream.schemas.keys import ROLES, KeyFileError, fills, new_keys, parse, render


@pytest.fixture(autouse=True)
def _no_rollstream_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("ROLLSTREAM_"):
            monkeypatch.delenv(name)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def keyed(home: Path) -> dict[str, str]:
    """A home with its key file; the keys by role."""
    create_keys(home)
    ring = read_keys(home)
    return {role: ring.get(role).get_secret_value() for role in ROLES}


def _secrets(value: object) -> object:
    if isinstance(value, list):
        return [v.get_secret_value() for v in value]
    return value.get_secret_value() if isinstance(value, SecretStr) else value


@pytest.fixture
def open_umask() -> Iterator[None]:
    old = os.umask(0)  # a umask that would leave a new file 0666
    try:
        yield
    finally:
        os.umask(old)


# --------------------------------------------------------------------------- the file


def test_the_file_is_made_once_for_the_owner_only(home: Path, open_umask: None) -> None:
    path, created = create_keys(home)
    assert created and path == home / "keys.json" == key_path(home)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not [p.name for p in home.iterdir() if p.name != "keys.json"]  # no temporary left
    keys = json.loads(path.read_text())["keys"]
    assert list(keys) == list(ROLES)
    for role, key in keys.items():
        assert key.startswith(f"rs_{role}_") and len(key) >= len(f"rs_{role}_") + 43
    assert len(set(keys.values())) == len(ROLES)


def test_an_existing_file_is_never_overwritten(home: Path) -> None:
    path, _ = create_keys(home)
    before = path.read_bytes()
    assert create_keys(home) == (path, False)
    assert path.read_bytes() == before


def test_a_file_made_by_another_up_meanwhile_stands(home: Path) -> None:
    """Two ``rollstream up`` at once: the second one's keys are made while the first one's
    file appears; the first one's stays, and the second says it made none."""
    theirs = render(new_keys(lambda: "t" * 43))
    calls = 0

    def token() -> str:  # called while this create is under way, after its check
        nonlocal calls
        calls += 1
        if calls == 1:
            fd = os.open(home / "keys.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, theirs.encode())
            os.close(fd)
        return "m" * 43

    home.mkdir()
    path, created = create_keys(home, token=token)
    assert calls == len(ROLES) and not created
    assert path.read_text() == theirs
    assert [p.name for p in home.iterdir()] == ["keys.json"]


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o660])
def test_a_file_others_may_open_is_refused(home: Path, mode: int) -> None:
    path, _ = create_keys(home)
    before = path.read_bytes()
    path.chmod(mode)
    for attempt in (
        lambda: read_keys(home),
        lambda: create_keys(home),
        lambda: ProxySettings(home=home),
        lambda: StackSettings(home=home),
    ):
        with pytest.raises(KeyFileError) as err:
            attempt()
        assert str(path) in str(err.value) and f"chmod 600 {path}" in str(err.value)
        assert f"mode {mode:04o}" in str(err.value)
    assert path.read_bytes() == before  # not rewritten


def test_a_directory_or_fifo_in_its_place_is_refused(home: Path) -> None:
    (home / "keys.json").mkdir(parents=True)
    with pytest.raises(KeyFileError, match="is no regular file"):
        read_keys(home)
    with pytest.raises(KeyFileError, match="is no regular file"):
        create_keys(home)
    (home / "keys.json").rmdir()
    os.mkfifo(home / "keys.json", 0o600)  # read without a writer: it would block
    with pytest.raises(KeyFileError, match="is no regular file"):
        ProxySettings(home=home)


def test_a_read_only_file_is_fine(home: Path, keyed: dict[str, str]) -> None:
    key_path(home).chmod(0o400)
    assert read_keys(home).get("admin").get_secret_value() == keyed["admin"]


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        (b"{", "no JSON"),
        (b"\xff\xfe", "no JSON"),
        (b"[]", "`format`"),
        (b'{"format": 2, "keys": {}}', "`format`"),
        (b'{"format": 1, "keys": []}', "`keys`"),
        (b'{"format": 1, "keys": {"admin": "rs_admin_' + b"a" * 43 + b'"}}', "`keys.evaluator`"),
        (b" " * (64 * 1024 + 1), "over 65536 bytes"),
    ],
)
def test_a_file_that_is_no_key_file_is_refused_naming_what(raw: bytes, names: str) -> None:
    with pytest.raises(KeyFileError) as err:
        parse(raw, "/h/keys.json")
    assert "/h/keys.json" in str(err.value) and names in str(err.value)


def test_a_key_of_another_role_is_refused() -> None:
    keys = json.loads(render(new_keys(lambda: "k" * 43)))
    keys["keys"]["admin"] = keys["keys"]["analyst"]  # the analyst's key passed off as admin
    with pytest.raises(KeyFileError, match=r"`keys\.admin` is no key of that role"):
        parse(json.dumps(keys).encode(), "keys.json")
    keys["keys"]["admin"] = "rs_admin_short"
    with pytest.raises(KeyFileError, match=r"`keys\.admin`"):
        parse(json.dumps(keys).encode(), "keys.json")


def test_no_key_is_shown_by_repr() -> None:
    ring = new_keys(lambda: "s" * 43)
    assert "sss" not in repr(ring) and "sss" not in str(ring.keys)


# --------------------------------------------------------------------------- the settings


def test_the_unset_key_settings_of_every_service_are_filled(
    home: Path, keyed: dict[str, str]
) -> None:
    proxy = ProxySettings(home=home)
    assert _secrets(proxy.proxy_api_keys) == [keyed["admin"]]
    assert _secrets(proxy.proxy_evaluator_keys) == [keyed["evaluator"]]
    assert _secrets(proxy.proxy_backend_api_key) == keyed["model"]
    assert _secrets(proxy.proxy_backend_admin_key) == keyed["admin"]
    assert _secrets(proxy.metrics_key) == keyed["metrics"]
    model = ModelServerSettings(home=home)
    assert _secrets(model.model_api_key) == keyed["model"]
    assert _secrets(model.model_admin_key) == keyed["admin"]
    sink = SinkServiceSettings(home=home)
    assert _secrets(sink.analytics_api_keys) == [keyed["analyst"], keyed["admin"]]
    assert _secrets(ReportSettings(home=home).analytics_api_key) == keyed["analyst"]
    workers = RolloutSettings(home=home)
    assert _secrets(workers.rollouts_admin_key) == keyed["admin"]
    assert _secrets(workers.rollouts_evaluator_key) == keyed["evaluator"]
    assert _secrets(ControlSettings(home=home).control_proxy_admin_key) == keyed["admin"]
    assert _secrets(StackSettings(home=home).metrics_key) == keyed["metrics"]


def test_the_home_of_the_environment_is_the_one_read(
    home: Path, keyed: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLSTREAM_HOME", str(home))
    assert _secrets(ModelServerSettings().model_api_key) == keyed["model"]


def test_a_value_set_by_hand_wins(
    home: Path, keyed: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLSTREAM_PROXY_API_KEYS", "mine-1,mine-2")
    monkeypatch.setenv("ROLLSTREAM_METRICS_KEY", "scrape")
    proxy = ProxySettings(home=home, proxy_backend_api_key="backend")
    assert _secrets(proxy.proxy_api_keys) == ["mine-1", "mine-2"]
    assert _secrets(proxy.proxy_backend_api_key) == "backend"
    assert _secrets(proxy.metrics_key) == "scrape"
    sink = SinkServiceSettings(home=home, analytics_api_keys="a1")
    assert _secrets(sink.analytics_api_keys) == ["a1"]


def test_an_empty_value_counts_as_unset(
    home: Path, keyed: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLSTREAM_MODEL_API_KEY", "")
    monkeypatch.setenv("ROLLSTREAM_PROXY_API_KEYS", "")
    assert _secrets(ModelServerSettings(home=home).model_api_key) == keyed["model"]
    assert _secrets(ProxySettings(home=home).proxy_api_keys) == [keyed["admin"]]


def test_a_workers_admin_key_by_hand_keeps_the_files_evaluator_key_out(
    home: Path, keyed: dict[str, str]
) -> None:
    """The demo gives its workers the admin key of a proxy of its own: the EVAL stage must not
    send that proxy the file's evaluator key (it falls back to the admin key)."""
    workers = RolloutSettings(home=home, rollouts_admin_key="demo-admin")
    assert _secrets(workers.rollouts_admin_key) == "demo-admin"
    assert workers.rollouts_evaluator_key is None
    assert _secrets(workers.metrics_key) == keyed["metrics"]  # not of that group


def test_a_model_key_by_hand_keeps_the_files_admin_key_off_the_weight_routes(
    home: Path, keyed: dict[str, str]
) -> None:
    """The demo gives its model server and proxy a model key of their own: the server must not
    open its weight routes to the file's admin key while the proxy sends another (both fall
    back to their model key, which match)."""
    model = ModelServerSettings(home=home, model_api_key="demo-model")
    assert _secrets(model.model_api_key) == "demo-model" and model.model_admin_key is None
    proxy = ProxySettings(home=home, proxy_backend_api_key="demo-model")
    assert proxy.proxy_backend_admin_key is None
    assert _secrets(proxy.proxy_api_keys) == [keyed["admin"]]  # not of that group
    both = ModelServerSettings(home=home, model_api_key="m", model_admin_key="a")
    assert (_secrets(both.model_api_key), _secrets(both.model_admin_key)) == ("m", "a")
    admin_only = ProxySettings(home=home, proxy_backend_admin_key="a")  # the model key too
    assert admin_only.proxy_backend_api_key is None


def test_the_admin_role_fills_the_model_servers_weight_routes_pairwise() -> None:
    ring = new_keys(lambda: "w" * 43)
    admin, model = ring.get("admin"), ring.get("model")
    unset = {"model_api_key": None, "model_admin_key": None}
    assert fills(ring, unset) == {"model_api_key": model, "model_admin_key": admin}
    assert fills(ring, {**unset, "model_api_key": SecretStr("x")}) == {}
    backend = {"proxy_backend_api_key": None, "proxy_backend_admin_key": SecretStr("")}
    assert fills(ring, backend) == {
        "proxy_backend_api_key": model,
        "proxy_backend_admin_key": admin,
    }


def test_insecure_fills_nothing_and_reads_no_file(
    home: Path, keyed: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLSTREAM_INSECURE", "true")
    proxy = ProxySettings(home=home)
    assert proxy.insecure and proxy.proxy_api_keys == [] and proxy.proxy_backend_api_key is None
    assert proxy.metrics_key is None
    assert ModelServerSettings(home=home).model_api_key is None
    assert ModelServerSettings(home=home).model_admin_key is None
    assert proxy.proxy_backend_admin_key is None
    assert SinkServiceSettings(home=home).analytics_api_keys == []
    key_path(home).chmod(0o644)  # not read at all
    assert RolloutSettings(home=home).rollouts_admin_key is None


def test_a_home_without_the_file_is_as_before(home: Path) -> None:
    assert ProxySettings(home=home).proxy_api_keys == []
    assert ModelServerSettings(home=home).model_api_key is None
    assert CommonSettings(home=home).metrics_key is None
    assert not home.exists()  # reading made nothing


def test_the_proxy_tells_the_evaluator_key_apart_once_it_can() -> None:
    """With a ``proxy_evaluator_keys`` setting the proxy's admin keys are the admin's only."""
    ring = new_keys(lambda: "e" * 43)
    admin, evaluator = ring.get("admin"), ring.get("evaluator")
    today = fills(ring, {"proxy_api_keys": []})
    assert today == {"proxy_api_keys": [admin, evaluator]}
    later = fills(ring, {"proxy_api_keys": [], "proxy_evaluator_keys": []})
    assert later == {"proxy_api_keys": [admin], "proxy_evaluator_keys": [evaluator]}
    by_hand = fills(ring, {"proxy_api_keys": [SecretStr("x")], "proxy_evaluator_keys": []})
    assert by_hand == {}


# --------------------------------------------------------------------------- the CLI


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    return subprocess.run(
        [sys.executable, "-m", "rollstream.infra.cli", *args],
        env={**env, "ROLLSTREAM_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_cli_knows_every_role() -> None:
    assert KEY_ROLES == ROLES


def test_keys_show_prints_one_key_for_scripts(home: Path) -> None:
    missing = _cli(home, "keys", "show", "admin")
    assert missing.returncode == 1 and missing.stdout == ""
    assert f"no key file at {home / 'keys.json'}" in missing.stderr
    path = _cli(home, "keys", "path")
    assert path.returncode == 1 and path.stdout == f"{home / 'keys.json'}\n"

    made = _cli(home, "keys", "create")
    assert made.returncode == 0 and made.stdout == "", made.stderr
    ring = read_keys(home)
    assert made.stderr == f"keys: created {home / 'keys.json'}\n"  # the path, never a key
    shown = _cli(home, "keys", "show", "evaluator")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == ring.get("evaluator").get_secret_value() + "\n"
    assert _cli(home, "keys", "show").returncode == 2
    assert _cli(home, "keys", "show", "harness").returncode == 2  # no role: a harness holds a token
