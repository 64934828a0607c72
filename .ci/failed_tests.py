"""Print the tests a pytest JUnit XML report records as failed or errored, one line each with
the first line of the message, so the end of a long CI log names them (pytest's own summary
prints whole assertion diffs on CI, which can push the names out of view)."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def main(path: str) -> int:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        print(f"no test report at {path}: {exc}")
        return 1
    bad = []
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            node = case.find(kind)
            if node is not None:
                name = f"{case.get('classname', '')}::{case.get('name', '')}"
                message = (node.get("message") or "").strip().splitlines()
                bad.append(f"{kind.upper()} {name}: {(message[0] if message else '')[:300]}")
    print(f"== {len(bad)} failed test(s):")
    for line in bad:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
