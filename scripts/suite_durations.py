"""Each test module's seconds in a run of the suite, for the order scripts/test.sh hands modules to its workers.

    .venv/bin/python scripts/suite_durations.py JUNIT.xml > tests/durations.json

JUNIT.xml: ``scripts/test.sh --junitxml JUNIT.xml`` on the CI box. A module's seconds are its tests' (setup, call and
teardown: its module fixtures' starts are charged to its first test). tests/conftest.py starts the longest units
first, so the shortest fill the end of the run on both workers; a module missing from the file counts as the median.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_of(classname: str) -> str:
    """``tests.core.test_x.TestY`` -> ``tests/core/test_x.py`` (the longest dotted prefix that is a file)."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (ROOT / path).is_file():
            return path
    raise SystemExit(f"no test module for {classname!r} under {ROOT}")


def module_seconds(junit: Path) -> dict[str, float]:
    seconds: defaultdict[str, float] = defaultdict(float)
    for case in ET.parse(junit).iter("testcase"):
        seconds[module_of(case.get("classname", ""))] += float(case.get("time", 0))
    return {module: round(s, 1) for module, s in sorted(seconds.items())}


if __name__ == "__main__":
    json.dump(module_seconds(Path(sys.argv[1])), sys.stdout, indent=1)
    sys.stdout.write("\n")
