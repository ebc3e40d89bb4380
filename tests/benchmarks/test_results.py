"""Every committed benchmark table is its JSON rendered: a hand-edited ``.md`` (or one written without its JSON)
fails here. Re-run the benchmark (``python -m benchmarks NAME``) or edit the JSON, never the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.report import RESULTS, document, render

SCHEMA = {"benchmark", "commit", "node", "date", "command", "source", "parameters", "metrics", "rows", "document"}
TABLES = sorted(RESULTS.glob("*.md"))


@pytest.mark.parametrize("table", TABLES, ids=lambda p: p.name)
def test_table_is_its_json_rendered(table: Path) -> None:
    source = table.with_suffix(".json")
    assert source.exists(), f"{table.name} has no {source.name}: write both with benchmarks.report.write"
    result = json.loads(source.read_text())
    assert set(result) == SCHEMA
    assert render(result) == table.read_text()


def test_every_result_has_its_table() -> None:
    assert {p.stem for p in RESULTS.glob("*.json")} == {p.stem for p in TABLES}


@pytest.mark.parametrize("table", TABLES, ids=lambda p: p.name)
def test_a_written_table_reads_back(table: Path) -> None:
    """``report.document`` takes what a benchmark shows apart into text and tables that render it back."""
    text = table.read_text()
    assert render({"document": document(text)}) == text
