"""``python -m benchmarks NAME [--smoke]`` finds every benchmark, and a smoke run writes its result as the committed
ones are: the JSON of ``benchmarks.report`` and the table rendered from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.__main__ import benchmarks, main
from benchmarks.report import render
from tests.benchmarks.test_results import SCHEMA


def test_the_runner_names_every_benchmark() -> None:
    names = benchmarks()
    wanted = {"writer", "put", "dataset_hash", "audit_memory", "e2e", "regenerate", "tp", "stream", "acceptance"}
    assert wanted <= set(names)
    with pytest.raises(SystemExit) as said:
        main([])
    assert all(f"  {name} " in str(said.value) for name in names)


def test_a_smoke_run_writes_its_json_and_the_table_rendered_from_it(tmp_path: Path) -> None:
    main(["put", "--smoke", "--out", str(tmp_path / "put.md")])
    result = json.loads((tmp_path / "put.json").read_text())
    assert set(result) == SCHEMA and result["benchmark"] == "put" and result["source"] == "measured"
    assert [row[0] for row in result["rows"]] == ["a put: pages used before", "a put: fresh pages",
                                                  "a put: a faulted-in segment", "a put: pages used before, sent over TCP",
                                                  "a read: fresh memory",
                                                  "a read: a kept buffer"]  # fmt: skip
    assert render(result) == (tmp_path / "put.md").read_text()
