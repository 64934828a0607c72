"""The pure core imports no I/O library (STYLE 1): checked in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = (
    "faust",
    "aiokafka",
    "confluent_kafka",
    "clickhouse_connect",
    "chdb",
    "httpx",
    "starlette",
)

PROBE = """
import importlib, json, pkgutil, sys
from rollstream.streams import core
names = [m.name for m in pkgutil.walk_packages(core.__path__, core.__name__ + ".")]
for name in names:
    importlib.import_module(name)
roots = sorted({m.split(".")[0] for m in sys.modules})
print(json.dumps({"modules": names, "roots": roots}))
"""


def test_core_modules_import_no_io_library() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    # every module of the core was imported, not just the package
    assert {"rollstream.streams.core.trajectory", "rollstream.streams.core.samples"} <= set(
        seen["modules"]
    )
    assert len(seen["modules"]) >= 8
    assert sorted(set(FORBIDDEN) & set(seen["roots"])) == []
