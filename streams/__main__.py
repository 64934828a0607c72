"""``python -m rollstream.streams``: one processor worker, settings from ROLLSTREAM_* variables."""

from __future__ import annotations

import sys

from .app import run
from .settings import ProcessorSettings

if __name__ == "__main__":
    sys.exit(run(ProcessorSettings()))
