"""One error root for rollstream.consumers: every exception class its modules define derives from
ConsumerError, the tree in errors.py's docstring draws every one of them, and the old names are
importable from the modules that raise them."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import pytest

import rollstream.consumers
from rollstream.consumers import errors
from rollstream.consumers.errors import ConsumerError


def _modules() -> list[str]:
    return [
        m.name
        for m in pkgutil.walk_packages(rollstream.consumers.__path__, "rollstream.consumers.")
    ]


def _exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for name in _modules():
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__.startswith("rollstream.consumers"):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_consumers_exception_derives_from_consumer_error() -> None:
    classes = _exception_classes()
    assert len(classes) >= 20, sorted(classes)
    strays = [name for name, cls in classes.items() if not issubclass(cls, ConsumerError)]
    assert not strays, f"exceptions outside the ConsumerError tree: {strays}"


def test_the_docstring_draws_every_error_with_its_parent() -> None:
    doc = errors.__doc__ or ""
    drawn: dict[str, str] = {}  # name -> parent, from the tree's indentation
    stack: list[tuple[int, str]] = []
    for line in doc.splitlines():
        m = re.search(r"\b([A-Z]\w*(?:Error|Query))\b", line)
        if not m or set(line[: m.start()]) - set(" │├└─") or ("──" not in line and m.start() > 4):
            continue  # not a line of the tree (prose, or a name that is not its first word)
        depth = m.start()
        while stack and stack[-1][0] >= depth:
            stack.pop()
        drawn[m.group(1)] = stack[-1][1] if stack else ""
        stack.append((depth, m.group(1)))
    defined = {name: getattr(errors, name) for name in errors.__all__}
    assert set(drawn) == set(defined)
    for name, parent in drawn.items():
        cls = defined[name]
        if parent:
            assert cls.__bases__[0] is defined[parent], (name, parent)


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("rollstream.consumers.store.chstore", "StoreError"),
        ("rollstream.consumers.store.chstore", "ConnectError"),
        ("rollstream.consumers.store.chstore", "InsertError"),
        ("rollstream.consumers.store.chstore", "QueryError"),
        ("rollstream.consumers.store.chstore", "MigrationError"),
        ("rollstream.consumers.store.chstore", "RowError"),
        ("rollstream.consumers.store.rows", "RowError"),
        ("rollstream.consumers.store.rows", "StoreError"),
        ("rollstream.consumers.store.migrations", "MigrationError"),
        ("rollstream.consumers.store.sink", "SinkError"),
        ("rollstream.consumers.store.sink", "DeadLetterError"),
        ("rollstream.consumers.store.sink", "InsertRetryError"),
        ("rollstream.consumers.analytics.server", "AnalyticsError"),
        ("rollstream.consumers.analytics.server", "RefusedQuery"),
        ("rollstream.consumers.analytics.server", "AnalyticsHTTPError"),
        ("rollstream.consumers.analytics.replay", "ReplayError"),
        ("rollstream.consumers.analytics.report_cli", "ReportError"),
        ("rollstream.consumers.training.trainer", "TrainerError"),
        ("rollstream.consumers.training.checkpoint", "CheckpointError"),
        ("rollstream.consumers.training.dataset", "SourceError"),
        ("rollstream.consumers.training.treepack", "TreeError"),
        ("rollstream.consumers.training.batching", "BatchingError"),
    ],
)
def test_old_names_stay_importable(module: str, name: str) -> None:
    assert getattr(importlib.import_module(module), name) is getattr(errors, name)


def test_value_errors_stay_value_errors() -> None:
    assert issubclass(errors.TreeError, ValueError)
    assert issubclass(errors.BatchingError, ValueError)
    assert issubclass(errors.BatchingError, ConsumerError)
