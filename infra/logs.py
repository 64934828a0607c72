"""Logging of the ``rollstream`` commands: one setup for every subcommand, two audiences.

A console command (``up``, ``status``, ``tail``, ``demo``, ``report``, ``replay``, ...) talks to
a person: stderr shows warnings and errors only, and each ``-v`` shows more:

    verbosity   rollstream's loggers   libraries (httpx, httpcore, uvicorn, faust, aiokafka, ...)
    0           WARNING                WARNING
    1 (-v)      INFO                   WARNING
    2 (-vv)     DEBUG                  INFO
    3 (-vvv)    DEBUG                  DEBUG

A service command (``serve-model``, ``proxy``, ``process``, ``train``, ``sink``) writes its log:
the supervisor (infra/services.py) sends its stderr to ``<home>/<namespace>/logs/<name>.log``.
There everything from INFO goes, library chatter included; ``-v`` adds rollstream's DEBUG,
``-vv`` everyone's.

``log_to_file(path)`` adds a file that takes INFO and up from everyone while the console stays
as it is: ``rollstream demo`` keeps its own HTTP requests (25k lines a run) there.

``ROLLSTREAM_LOG_FORMAT=json`` (``CommonSettings.log_format``) makes the stderr lines JSON, one
object a line, for log collectors: ``ts`` (UTC, ISO 8601, milliseconds), ``level``, ``logger``,
``message`` and, with an exception, ``exc`` (the traceback as text).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, TextIO

from pydantic import ValidationError

from rollstream.schemas.settings import CommonSettings

__all__ = [
    "CONSOLE_FORMAT",
    "SERVICE_FORMAT",
    "JsonFormatter",
    "levels",
    "log_format",
    "log_to_file",
    "setup_logging",
]

CONSOLE_FORMAT = "%(levelname)s %(name)s: %(message)s"
SERVICE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_OURS = ("rollstream", "__main__")


def levels(verbosity: int, *, service: bool = False) -> tuple[int, int]:
    """(threshold of rollstream's loggers, threshold of every other logger)."""
    v = max(0, verbosity)
    if service:
        ours = logging.INFO if v == 0 else logging.DEBUG
        return ours, logging.DEBUG if v >= 2 else logging.INFO
    ours = (logging.WARNING, logging.INFO)[v] if v < 2 else logging.DEBUG
    libraries = (logging.WARNING, logging.WARNING, logging.INFO)[v] if v < 3 else logging.DEBUG
    return ours, libraries


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts, level, logger, message, and exc when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        line = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        return json.dumps(line, ensure_ascii=False, default=str)


def log_format() -> Literal["text", "json"]:
    """``log_format`` of the environment's settings (ROLLSTREAM_LOG_FORMAT); text when the
    settings do not validate (the command itself reports that)."""
    try:
        return CommonSettings().log_format
    except ValidationError:
        return "text"


def _is_ours(name: str) -> bool:
    return any(name == root or name.startswith(root + ".") for root in _OURS)


class _Threshold(logging.Filter):
    """Passes a record at or above its origin's threshold (rollstream's or the libraries')."""

    def __init__(self, ours: int, libraries: int) -> None:
        super().__init__()
        self.ours, self.libraries = ours, libraries

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= (self.ours if _is_ours(record.name) else self.libraries)


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (as logging's last resort does), so a
    rich live display that redirects stderr prints the line above itself."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> TextIO:
        return sys.stderr


def _ours(handler: logging.Handler) -> bool:
    return getattr(handler, "_rollstream", False)


def _root_level(root: logging.Logger) -> int:
    """The root logger lets through what the most talkative of our handlers wants."""
    wanted = [
        min(f.ours, f.libraries)
        for h in root.handlers
        if _ours(h)
        for f in h.filters
        if isinstance(f, _Threshold)
    ]
    return min(wanted, default=logging.WARNING)


def setup_logging(
    verbosity: int = 0,
    *,
    service: bool = False,
    stream: TextIO | None = None,
    fmt: Literal["text", "json"] | None = None,
) -> None:
    """Configure the root logger for one command (see the module docstring). Calling it again
    replaces what an earlier call installed; other handlers are left alone. ``fmt`` None: the
    settings' ``log_format``."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if _ours(h) and not isinstance(h, logging.FileHandler)]:
        root.removeHandler(old)
    handler: logging.Handler = logging.StreamHandler(stream) if stream is not None else _Stderr()
    handler._rollstream = True  # type: ignore[attr-defined]
    if (fmt or log_format()) == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(SERVICE_FORMAT if service else CONSOLE_FORMAT))
    handler.addFilter(_Threshold(*levels(verbosity, service=service)))
    root.addHandler(handler)
    root.setLevel(_root_level(root))


@contextlib.contextmanager
def log_to_file(path: Path, level: int = logging.INFO) -> Iterator[Path]:
    """Also write every record at ``level`` and up (libraries' too) to ``path`` while inside."""
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    handler = logging.FileHandler(path, encoding="utf-8")
    handler._rollstream = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter(SERVICE_FORMAT))
    handler.addFilter(_Threshold(level, level))
    root.addHandler(handler)
    before = root.level
    root.setLevel(_root_level(root))
    try:
        yield path
    finally:
        root.removeHandler(handler)
        handler.close()
        root.setLevel(before)
