"""Every benchmark's result: one JSON schema, and the markdown rendered from it by one renderer.

A result is a JSON object written beside its table (``benchmarks/results/NAME.json`` and ``NAME.md``):

- ``benchmark``: the runner's name for it (``python -m benchmarks NAME``);
- ``commit``, ``node``, ``date``: the tree run, the machine (host name and boot id) and when, in UTC;
- ``command``: how it was invoked;
- ``source``: ``"measured"``, or where the figures come from when they were not measured by this code as it
  stands (``"transcribed from the table committed at <commit>; measured on <node> on <date>"``);
- ``parameters``: the run's options; ``metrics``: its headline figures; ``rows``: what it measured, one object per
  measurement, as the benchmark keeps it (a later call may read them back);
- ``document``: the table as a reader sees it: a list of blocks, each a markdown text or a table
  (``{"head": [...], "rows": [[...]]}``, cells as shown).

``render`` turns ``document`` into the ``.md`` committed beside it; tests/benchmarks/test_results.py renders every
committed JSON and compares it with its ``.md`` byte for byte, so a table is never edited by hand.
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from harness.processes import REPO_ROOT

RESULTS = REPO_ROOT / "benchmarks" / "results"
Block = str | dict[str, list]


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's command line: its docstring as the help, and the ``--smoke`` every benchmark has."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on this CPU: the code path, not a measurement")
    return ap


def table_lines(head: Sequence[object], rows: Sequence[Sequence[object]]) -> list[str]:
    """A markdown table's lines: the head, the rule, a line per row (cells as ``str`` gives them)."""
    return ["| " + " | ".join(map(str, head)) + " |", "|---" * len(head) + "|",
            *("| " + " | ".join(map(str, row)) + " |" for row in rows)]  # fmt: skip


def render(result: dict[str, Any]) -> str:
    """The markdown of a result: its document's blocks, one after the other, a newline between."""
    return "\n".join(
        b if isinstance(b, str) else "\n".join(table_lines(b["head"], b["rows"])) for b in result["document"]
    )


def parse_table(lines: list[str]) -> dict[str, list] | None:
    """The table ``lines`` hold, when ``table_lines`` gives them back exactly; else ``None`` (they stay text)."""
    cells = [line[2:-2].split(" | ") for line in lines if line.startswith("| ") and line.endswith(" |")]
    if len(lines) < 2 or len(cells) != len(lines) - 1 or lines[1] != "|---" * len(cells[0]) + "|":
        return None
    table = {"head": cells[0], "rows": cells[1:]}
    return table if table_lines(table["head"], table["rows"]) == lines else None


def document(markdown: str) -> list[Block]:
    """``markdown`` as a document: its runs of table lines as tables, what lies between as text, so that ``render``
    gives ``markdown`` back."""
    blocks: list[Block] = []
    text: list[str] = []
    lines = markdown.split("\n")
    i = 0
    while i < len(lines):
        j = i
        while j < len(lines) and lines[j].startswith("|"):
            j += 1
        table = parse_table(lines[i:j]) if j > i else None
        if table is None:
            text.append(lines[i])
            i += 1
            continue
        if text:
            blocks.append("\n".join(text))
        blocks.append(table)
        text, i = [], j
    blocks.append("\n".join(text))
    return blocks


def git_commit() -> str:
    """The short commit of the tree run: ``BENCH_COMMIT`` when set (the device's copy of the tree may carry no git, or
    a stale one), else git's, else what to do."""
    import os

    if commit := os.environ.get("BENCH_COMMIT"):
        return commit
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git here: set BENCH_COMMIT)"


def node() -> str:
    """The machine this run is on: its host name and boot id (lent machines may share a host name; a fresh one boots
    afresh, docs/performance.md)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "unknown"
    return f"{socket.gethostname()} boot {boot}"


def command_line() -> str:
    """How this benchmark was invoked, as a results table records it."""
    module = sys.modules["__main__"].__spec__
    name = module.name.removesuffix(".__main__") if module else None  # python -m benchmarks runs benchmarks.__main__
    return shlex.join(["python3", *(["-m", name] if name else sys.argv[:1]), *sys.argv[1:]])


def result(
    benchmark: str,
    markdown: str,
    *,
    parameters: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    rows: list[Any] | None = None,
    source: str = "measured",
) -> dict[str, Any]:
    """A result of this run, its ``document`` read from ``markdown`` (what the benchmark would show)."""
    return {"benchmark": benchmark, "commit": git_commit(), "node": node(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": command_line(), "source": source,
            "parameters": parameters or {}, "metrics": metrics or {}, "rows": rows or [],
            "document": document(markdown)}  # fmt: skip


def write(out: Path, result: dict[str, Any]) -> str:
    """Write ``result`` as ``out`` with a ``.json`` suffix and its rendering as ``out`` with ``.md``; the markdown."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    markdown = render(result)
    out.with_suffix(".md").write_text(markdown)
    return markdown


def read(path: Path) -> dict[str, Any]:
    """A result written by ``write`` (``path`` with either suffix)."""
    return json.loads(path.with_suffix(".json").read_text())


@dataclass
class Measured:
    """A result that grows as a benchmark's measurements end: a subclass says how its figures read (``body``);
    ``write``, called after each measurement, writes the JSON and the table as they stand, so a run cut short still
    leaves what it measured."""

    benchmark: ClassVar[str]
    path: Path
    header: list[str]
    parameters: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def body(self) -> list[str]:
        """The markdown lines between the header and the notes."""
        raise NotImplementedError

    def write(self) -> None:
        markdown = "\n".join([*self.header, *self.body(), "", *self.notes, ""])
        write(self.path, result(self.benchmark, markdown, parameters=self.parameters))
