"""`pip install rollstream` with no extras is the harness SDK: in a fresh venv, built from a copy of
this checkout (not editable), the Recorder imports and records a rollout to the real broker, and
none of the extras' heavy packages is installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
from _kafka_read import read_topic

from rollstream.infra.kafka import KafkaBroker
from rollstream.schemas import Codec, CommonSettings, LlmCall

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

# installed only by an extra (proxy, streams, sink, train, cli): never by the base install
HEAVY = (
    "chdb",
    "faust",
    "aiokafka",
    "pyarrow",
    "matplotlib",
    "torch",
    "transformers",
    "tokenizers",
    "httpx",
    "starlette",
    "uvicorn",
    "orjson",
    "clickhouse_connect",
    "rich",
    "jinja2",
)

# Runs in the fresh venv. argv[1]: JSON {bootstrap, namespace, home, heavy}.
RECORD = """
import importlib.util, json, sys
from pathlib import Path

import numpy as np

from rollstream.producers import Recorder, RecorderSettings
from rollstream.adapters.topics import ensure_topics
import rollstream.producers

args = json.loads(sys.argv[1])
settings = RecorderSettings(
    kafka_bootstrap=args["bootstrap"],
    namespace=args["namespace"],
    home=Path(args["home"]),
    spool_dir=Path(args["home"]) / "spool",
    producer="sdk-install",
)
ensure_topics(settings)
with Recorder(settings) as recorder:
    with recorder.rollout(task_id="task", group_id="group") as rollout:
        rollout.llm_call(
            np.arange(8, dtype=np.uint32),
            np.array([5, 6, 7], dtype=np.uint32),
            np.full(3, -0.25, dtype=np.float32),
        )
        rollout.reward(1.0)
print(json.dumps({
    "rollout_id": rollout.rollout_id,
    "sdk_file": rollstream.producers.__file__,
    "installed": [name for name in args["heavy"] if importlib.util.find_spec(name) is not None],
    "loaded": sorted({name.split(".")[0] for name in sys.modules}),
}))
"""


def copy_source(dest: Path) -> Path:
    """What a build of the project reads (pyproject, README, the package folders), copied so
    that the build's own files (build/, *.egg-info) are written there, not in the checkout."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, dest / name)
    for folder in sorted(set(project["tool"]["setuptools"]["package-dir"].values())):
        shutil.copytree(
            REPO / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    return dest


def run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{cmd[:4]} failed:\n{result.stdout[-4000:]}\n{result.stderr}"
    return result


def test_base_install_records_without_heavy_packages(
    kafka: KafkaBroker, namespace: str, tmp_path: Path
) -> None:
    source = copy_source(tmp_path / "source")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path, 120)
    python = str(venv / "bin" / "python")
    run([python, "-m", "pip", "install", "--quiet", str(source)], tmp_path, 400)

    args = {
        "bootstrap": kafka.bootstrap,
        "namespace": namespace,
        "home": str(tmp_path / "home"),
        "heavy": list(HEAVY),
    }
    # cwd is tmp_path: nothing there is named rollstream, so the import is the installed wheel's
    out = run([python, "-c", RECORD, json.dumps(args)], tmp_path, 120).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    assert Path(seen["sdk_file"]).is_relative_to(venv), seen["sdk_file"]
    assert seen["installed"] == []
    assert sorted(set(HEAVY) & set(seen["loaded"])) == []

    settings = CommonSettings(
        kafka_bootstrap=kafka.bootstrap, namespace=namespace, home=tmp_path / "home"
    )
    codec = Codec()
    events = [codec.decode(m.value()) for m in read_topic(settings, settings.topics().events)]
    mine = [e for e in events if e.rollout_id == seen["rollout_id"]]
    assert [e.kind for e in mine] == ["RolloutStarted", "LlmCall", "Reward", "RolloutFinished"]
    assert [e.seq for e in mine] == [0, 1, 2, 3]
    assert {e.producer for e in mine} == {"sdk-install"}
    call = mine[1].body
    assert isinstance(call, LlmCall)
    np.testing.assert_array_equal(call.completion_ids, [5, 6, 7])
    np.testing.assert_array_equal(call.prompt_delta, np.arange(8))
