"""The ``rollstream`` CLI as a user meets it: every command listed with a summary, flags whose
help names their variable and default, ``--version``, a quiet console (library chatter only
with -vv), and one helpful line when an extra is missing. The CLI runs in a fresh interpreter;
a missing extra is a real import failure (``sys.modules[name] = None``), not a mock."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata
from pathlib import Path

import pytest

from rollstream.infra.cli import COMMANDS, build_parser
from rollstream.infra.flags import build_settings
from rollstream.infra.logs import log_to_file, setup_logging

# What only an extra installs: the base install (`pip install rollstream`) has none of them.
EXTRAS_ONLY = (
    "rich",
    "httpx",
    "httpcore",
    "starlette",
    "uvicorn",
    "orjson",
    "ulid",
    "jinja2",
    "tokenizers",
    "faust",
    "mode",
    "aiokafka",
    "cramjam",
    "chdb",
    "clickhouse_connect",
    "pyarrow",
    "matplotlib",
    "torch",
    "transformers",
    "safetensors",
)


def rollstream(
    *args: str, blocked: Sequence[str] = (), env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``rollstream ARGS`` in a fresh interpreter where the ``blocked`` modules fail to
    import, as they do where their extra is not installed."""
    code = (
        "import sys\n"
        f"for name in {list(blocked)!r}:\n"
        "    sys.modules[name] = None\n"
        "from rollstream.infra.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        capture_output=True,
        text=True,
        timeout=180,
    )


# --------------------------------------------------------------------------- help and version


def test_help_lists_every_command_with_its_summary_on_the_base_install() -> None:
    out = rollstream("--help", blocked=EXTRAS_ONLY)
    assert out.returncode == 0, out.stderr
    for name, command in COMMANDS.items():
        assert f"    {name}" in out.stdout and command.summary in out.stdout, name
        assert len(command.summary.splitlines()) == 1


def test_version_is_the_installed_one_on_the_base_install() -> None:
    out = rollstream("--version", blocked=EXTRAS_ONLY)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"rollstream {metadata.version('rollstream')}"


def test_command_help_names_variables_and_defaults() -> None:
    up = rollstream("up", "--help", blocked=EXTRAS_ONLY)
    assert up.returncode == 0, up.stderr
    assert re.search(
        r"--bootstrap HOST:PORT +Kafka bootstrap servers "
        r"\[env ROLLSTREAM_KAFKA_BOOTSTRAP, default 127\.0\.0\.1:9092\]",
        up.stdout,
    ), up.stdout
    assert "[env ROLLSTREAM_HOME, default .rollstream]" in up.stdout
    # the model server's settings are light: its help needs no torch
    serve = rollstream("serve-model", "--help", blocked=EXTRAS_ONLY)
    assert serve.returncode == 0, serve.stderr
    assert "[env ROLLSTREAM_MODEL_PORT, default 8100]" in serve.stdout


def test_every_settings_flag_of_every_command_names_its_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "500")  # one line per flag
    for name, command in COMMANDS.items():
        with pytest.raises(SystemExit):
            build_parser([name]).parse_args([name, "--help"])
        lines = capsys.readouterr().out.splitlines()
        for flag in command.all_flags:
            line = next((ln for ln in lines if ln.lstrip().startswith(flag.names[0])), "")
            assert line.strip() != flag.names[0], f"{name} {flag.names[0]} has no help"
            if flag.setting is not None:
                assert f"[env ROLLSTREAM_{flag.setting.upper()}" in line, (name, line)
                assert ", default " in line, (name, line)


def test_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_MODEL_HOST", "0.0.0.0")
    monkeypatch.setenv("ROLLSTREAM_MODEL_PORT", "9000")
    serve = COMMANDS["serve-model"]
    settings = build_settings(serve, build_parser([serve.name]).parse_args(["serve-model"]))
    assert (settings.model_host, settings.model_port) == ("0.0.0.0", 9000)
    args = build_parser([serve.name]).parse_args(["serve-model", "--port", "9001"])
    settings = build_settings(serve, args)
    assert (settings.model_host, settings.model_port) == ("0.0.0.0", 9001)

    monkeypatch.setenv("ROLLSTREAM_KAFKA_BOOTSTRAP", "10.1.2.3:9092")
    up = COMMANDS["up"]
    args = build_parser([up.name]).parse_args(["up", "--port", "9999"])
    assert build_settings(up, args).kafka_bootstrap == "10.1.2.3:9999"


# --------------------------------------------------------------------------- missing extras


def test_a_missing_extra_is_one_line_and_exit_2() -> None:
    out = rollstream("process", blocked=["faust"])
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (
        "`rollstream process` needs the streams extra (no module 'faust'): "
        "pip install 'rollstream[streams]'"
    )
    up = rollstream("up", blocked=["rich"])
    assert up.returncode == 2 and "Traceback" not in up.stderr, up.stderr
    assert up.stderr.strip().endswith("pip install 'rollstream[cli]'")


# --------------------------------------------------------------------------- a quiet console


class _NotFound(BaseHTTPRequestHandler):
    """Answers 404 to everything: neither a rollstream analytics server nor ClickHouse."""

    requests: list[str] = []

    def do_GET(self) -> None:
        type(self).requests.append(self.path)
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_GET

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def not_found_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_console_shows_library_requests_only_with_vv(not_found_url: str, tmp_path: Path) -> None:
    """``rollstream report`` asks the URL over httpx (which logs each request at INFO), then
    fails: the error is shown, the request line only with -vv."""
    env = {"ROLLSTREAM_HOME": str(tmp_path)}
    args = ("report", "--sql", "SELECT 1", "--url", not_found_url)
    for verbose in ([], ["-v"]):
        _NotFound.requests.clear()
        out = rollstream(*verbose, *args, env=env)
        assert out.returncode == 1 and "error:" in out.stderr, out.stderr
        assert _NotFound.requests, "the command made no request"
        assert "HTTP Request" not in out.stderr, out.stderr
    out = rollstream("-vv", *args, env=env)
    assert "HTTP Request: GET" in out.stderr, out.stderr


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def _emit() -> None:
    logging.getLogger("rollstream.demo").debug("ours-debug")
    logging.getLogger("rollstream.demo").info("ours-info")
    logging.getLogger("rollstream.demo").warning("ours-warning")
    logging.getLogger("httpx").info("library-info")
    logging.getLogger("httpx").warning("library-warning")


@pytest.mark.parametrize(
    ("verbosity", "service", "shown"),
    [
        (0, False, {"ours-warning", "library-warning"}),
        (1, False, {"ours-info", "ours-warning", "library-warning"}),
        (2, False, {"ours-debug", "ours-info", "ours-warning", "library-info", "library-warning"}),
        (0, True, {"ours-info", "ours-warning", "library-info", "library-warning"}),
    ],
)
def test_setup_logging_levels(
    root_logger: logging.Logger, verbosity: int, service: bool, shown: set[str]
) -> None:
    everything = {"ours-debug", "ours-info", "ours-warning", "library-info", "library-warning"}
    stream = io.StringIO()
    setup_logging(verbosity, service=service, stream=stream)
    _emit()
    text = stream.getvalue()
    assert {m for m in everything if m in text} == shown


def test_log_file_takes_library_chatter_while_the_console_stays_quiet(
    root_logger: logging.Logger, tmp_path: Path
) -> None:
    console = io.StringIO()
    setup_logging(0, stream=console)
    with log_to_file(tmp_path / "logs" / "demo.log") as path:
        _emit()
    assert "library-info" in path.read_text() and "ours-info" in path.read_text()
    assert "library-info" not in console.getvalue() and "ours-warning" in console.getvalue()
    logging.getLogger("httpx").info("after")  # the file is closed and detached
    assert "after" not in path.read_text()
