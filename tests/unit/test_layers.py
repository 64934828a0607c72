"""The import contracts (pyproject's [tool.importlinter]) are live: lint-imports, run on a copy of
the rooms, keeps every contract on the tree as it is and breaks the right one when a module is
added that crosses a line (a lower layer importing a higher one, a cycle, a pure module or the
SDK importing an I/O or extra-only library)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
LINTER = PYPROJECT["tool"]["importlinter"]
CONTRACT_NAMES = {c["id"]: c["name"] for c in LINTER["contracts"]}
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


@dataclass(frozen=True)
class Tree:
    """A copy of the rooms under ``src/rollstream/`` and the project's own config beside it."""

    root: Path

    def lint(self, *contract_ids: str) -> subprocess.CompletedProcess[str]:
        selected = [arg for cid in contract_ids for arg in ("--contract", cid)]
        env = {
            **os.environ,
            "PYTHONPATH": str(self.root / "src"),  # `rollstream` is the copy, not the checkout
            "COLUMNS": "200",  # no wrapped lines in the report
            "NO_COLOR": "1",
        }
        return subprocess.run(
            [str(LINT_IMPORTS), "--no-cache", "--no-logo", *selected, "pyproject.toml"],
            cwd=self.root,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def add(self, files: dict[str, str]) -> None:
        for rel, text in files.items():
            (self.root / "src" / "rollstream" / rel).write_text(text)

    def remove(self, files: dict[str, str]) -> None:
        for rel in files:
            (self.root / "src" / "rollstream" / rel).unlink()


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tree]:
    root = tmp_path_factory.mktemp("layers")
    package = root / "src" / "rollstream"  # no __init__.py: a namespace package, as installed
    package.mkdir(parents=True)
    folders = PYPROJECT["tool"]["setuptools"]["package-dir"]
    for name in LINTER["root_packages"]:
        room = name.removeprefix("rollstream.")
        shutil.copytree(
            REPO / folders[name],
            package / room,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    yield Tree(root)


def test_the_rooms_keep_every_contract(tree: Tree) -> None:
    assert LINT_IMPORTS.exists(), "import-linter is not installed (the dev extra has it)"
    result = tree.lint()
    out = result.stdout + result.stderr
    # the copy was analysed, not an empty graph
    assert "Analyzed 0 files" not in out
    for name in CONTRACT_NAMES.values():
        assert f"{name} KEPT" in out, out
    assert result.returncode == 0, out


@dataclass(frozen=True)
class Crossing:
    contract: str  # the id of the contract it breaks
    files: dict[str, str]  # new modules, relative to the rollstream package
    reported: tuple[str, ...]  # what the report names


CROSSINGS = {
    "schemas-imports-infra": Crossing(
        "layers",
        {"schemas/leak.py": "import rollstream.infra.cli\n"},
        ("rollstream.schemas.leak -> rollstream.infra.cli",),
    ),
    "streams-imports-consumers": Crossing(
        "layers",
        {"streams/leak.py": "import rollstream.consumers.store.batches\n"},
        ("rollstream.streams.leak -> rollstream.consumers.store.batches",),
    ),
    "store-imports-analytics": Crossing(
        "consumers-layers",
        {"consumers/store/leak.py": "import rollstream.consumers.analytics.reports\n"},
        ("rollstream.consumers.store.leak -> rollstream.consumers.analytics.reports",),
    ),
    "training-imports-store": Crossing(
        "training-store",
        {"consumers/training/leak.py": "import rollstream.consumers.store.batches\n"},
        ("rollstream.consumers.training.leak -> rollstream.consumers.store.batches",),
    ),
    "sdk-imports-proxy": Crossing(
        "producers-layers",
        {"producers/sdk/leak.py": "import rollstream.producers.proxy.chat\n"},
        ("rollstream.producers.sdk.leak -> rollstream.producers.proxy.chat",),
    ),
    "sibling-cycle": Crossing(
        "acyclic-siblings",
        {
            "adapters/leak_a.py": "import rollstream.adapters.leak_b\n",
            "adapters/leak_b.py": "import rollstream.adapters.leak_a\n",
        },
        ("No cycles are allowed in rollstream.adapters.", ".leak_"),
    ),
    "pure-core-imports-aiokafka": Crossing(
        "pure",
        {"streams/core/leak.py": "def f() -> None:\n    import aiokafka  # noqa: F401\n"},
        ("rollstream.streams.core is not allowed to import aiokafka",),
    ),
    "sdk-imports-orjson": Crossing(
        "sdk-light",
        {"producers/sdk/leak.py": "import orjson\n"},
        ("rollstream.producers.sdk is not allowed to import orjson", "sdk.leak -> orjson"),
    ),
}


@pytest.mark.parametrize("crossing", CROSSINGS.values(), ids=CROSSINGS.keys())
def test_a_crossing_breaks_its_contract(tree: Tree, crossing: Crossing) -> None:
    tree.add(crossing.files)
    try:
        result = tree.lint(crossing.contract)
    finally:
        tree.remove(crossing.files)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert f"{CONTRACT_NAMES[crossing.contract]} BROKEN" in out, out
    for text in crossing.reported:
        assert text in out, out
