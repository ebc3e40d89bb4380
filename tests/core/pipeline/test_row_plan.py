"""The row planner (`layertap.pipeline.rows`): each row of a run planned from one stream of the dataset, with the model
folder read once; the plan a resume follows and `verify --data` reports."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from layertap.data.scan import scan_dataset
from layertap.models.folder import ModelFolder
from layertap.pipeline import run_extraction
from layertap.pipeline.rows import RowPlanner
from layertap.pipeline.steps import Tokenize
from layertap.spec import ExtractionSpec
from layertap.store.manifest import MANIFEST, read_manifest
from layertap.store.store import OutputStore
from layertap.verify import verify_store
from tests.core.datasets import conversation_rows, write_jsonl
from tests.folder_reads import counting_folder_reads
from tests.hf_engines import cpu_hf

_opens: dict[str, int] = {}  # path -> times opened, for the paths being watched
_hooked: list[bool] = []


def _count_open(event: str, args: tuple) -> None:
    if event == "open" and isinstance(args[0], str | bytes | os.PathLike) and (path := os.fsdecode(args[0])) in _opens:
        _opens[path] += 1


@contextmanager
def counting_opens(path: Path) -> Iterator[Callable[[], int]]:
    """How many times ``path`` is opened (every ``open()``: the reader's, the hash's), so far, inside the block."""
    if not _hooked:  # an audit hook cannot be removed: one for the session, counting only watched paths
        sys.addaudithook(_count_open)
        _hooked.append(True)
    _opens[str(path)] = 0
    try:
        yield lambda: _opens[str(path)]
    finally:
        del _opens[str(path)]


class Bar:
    """A ``ProgressSink`` that keeps the count a progress bar shows."""

    def start(self, total: int, already_done: int) -> None:
        self.total, self.completed = total, already_done

    def advance(self, samples: int, tokens: int) -> None:
        self.completed += samples


def test_a_resume_streams_its_dataset_once_after_the_hash_scan(tiny_llama, tmp_path) -> None:
    rows = conversation_rows(12, seed=5, max_words=20)
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    spec = ExtractionSpec(model=tiny_llama, data=data, layers=(1, 3, 5))
    out = tmp_path / "out"
    run_extraction(spec, out, cpu_hf(batch_size=1))
    rows[4]["messages"][-1]["content"] += " edited"  # one stored sample its row no longer gives
    write_jsonl(data, rows)

    bar = Bar()
    with counting_opens(data) as opens:
        scan_dataset(data)
        scan = opens()
        report = run_extraction(spec, out, cpu_hf(batch_size=1), progress=bar)
        resume = opens() - scan
    assert scan >= 1 and resume == scan + 1, (scan, resume)  # the scan's reads, then the rows once
    assert report.changed == ["conv-4"] and report.computed == ["conv-4"] and report.already_done == len(rows) - 1
    assert (bar.completed, bar.total) == (len(rows), len(rows))  # the retired sample counted once, when redone
    assert verify_store(out, data=data).ok


def test_a_run_reads_the_model_folders_facts_once_for_its_engine_its_rows_and_its_guide(
    tiny_llama, tmp_path, monkeypatch
) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(6, seed=2, max_words=12))
    spec = ExtractionSpec(model=tiny_llama, data=data, layers=(1, 3, 5))
    for _ in ("fresh", "resumed"):
        with counting_folder_reads(monkeypatch) as reads:
            run_extraction(spec, tmp_path / "out", cpu_hf(batch_size=1))
        assert reads == {"layertap.pipeline.plan": 1}, reads
    with counting_folder_reads(monkeypatch) as reads:
        verify_store(tmp_path / "out")
    assert reads == {"layertap.store.guide": 1}, reads  # the count sees a read outside the pipeline


def test_each_row_is_planned_done_changed_todo_or_error_as_a_resume_handles_it(tiny_llama, tmp_path) -> None:
    rows = conversation_rows(8, seed=9, max_words=15)
    rows[6] = {"id": "no-answer", "messages": [{"role": "user", "content": "hello?"}]}  # never gives a sample
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    spec = ExtractionSpec(model=tiny_llama, data=data, layers=(1, 3, 5))
    out = tmp_path / "out"
    run_extraction(spec, out, cpu_hf(batch_size=1))
    rows[2]["messages"][-1]["content"] += " edited"
    rows[5]["id"] = rows[0]["id"]  # a repeated id: the first row keeps it
    write_jsonl(data, [*rows[:7], rows[7] | {"id": "new-7"}])  # row 7 gives a sample under another id

    records = OutputStore.open_existing(out).records()
    tokenize = Tokenize(ModelFolder.read(tiny_llama), spec, spec.max_length)
    planner = RowPlanner(spec, tokenize, duplicates=scan_dataset(data).duplicates)
    plan = [(p.row, p.status) for p in planner.plan(records)]
    assert plan == [(0, "done"), (1, "done"), (2, "changed"), (2, "todo"), (3, "done"), (4, "done"),
                    (5, "changed"), (5, "error"), (6, "error"), (7, "changed"), (7, "todo")]  # fmt: skip
    why = {p.row: p.why for p in planner.plan(records) if p.status == "changed"}
    assert "other tokens or another loss mask" in why[2]
    assert "no longer gives a sample: duplicate id 'conv-0'" in why[5] and "has the id 'new-7' now" in why[7]
    assert [p.status for p in planner.plan(records, start=3, stop=5)] == ["done", "done"]
    recorded = [(p.row, p.status) for p in planner.plan(records, unrecorded=False)]
    assert recorded == [item for item in plan if item != (6, "error")]  # verify asks only about stored rows

    write_jsonl(data, rows[:5])  # rows 5 to 7 gone: their records are changed once the stream ends
    gone = RowPlanner(spec, tokenize).plan(records, start=4)
    assert [(p.row, p.status, p.why.endswith(f"is not in {data}")) for p in gone] == [
        (4, "done", False), (5, "changed", True), (7, "changed", True)
    ]  # fmt: skip


def test_a_store_made_before_the_input_limit_was_recorded_or_named_so_opens_and_verifies_with_its_limit(
    tiny_llama, tmp_path
) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(5, seed=3, max_words=30))
    spec = ExtractionSpec(model=tiny_llama, data=data, layers=(1, 3, 5), max_length=40)
    out = tmp_path / "out"
    first = run_extraction(spec, out, cpu_hf(batch_size=1))
    stored = len(first.computed)
    assert stored and first.truncated, first  # truncated samples too, compared at their stored length
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest.pop("input_limit") == 40  # the HF engine has no input limit of its own
    (out / MANIFEST).write_text(json.dumps(manifest | {"effective_max_length": 40}))  # the limit's old name
    assert read_manifest(out).input_limit == 40
    (out / MANIFEST).write_text(json.dumps(manifest))  # as a layertap older still wrote it: no limit recorded
    assert read_manifest(out).input_limit == 40
    check = verify_store(out, data=data)
    assert check.ok and check.samples == stored, check.problems
    assert run_extraction(spec, out, cpu_hf(batch_size=1)).already_done == stored  # and a resume takes it as it is


def test_a_new_row_whose_id_no_capture_request_can_name_is_its_own_error_when_planned(tiny_llama, tmp_path) -> None:
    rows = conversation_rows(3, seed=2, max_words=10)
    rows[1]["id"] = "x" * 190  # within a dump folder's name alone, not once the rid's prefix, job and attempt join it
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    spec = ExtractionSpec(model=tiny_llama, data=data, layers=(1, 3, 5))
    tokenize = Tokenize(ModelFolder.read(tiny_llama), spec, spec.max_length)
    planned = list(RowPlanner(spec, tokenize, rid=("hscap", "job")).plan({}))
    assert [(p.row, p.status) for p in planned] == [(0, "todo"), (1, "error"), (2, "todo")]
    assert planned[1].error is not None and "too long for a dump folder name" in planned[1].error.reason
    assert [p.status for p in RowPlanner(spec, tokenize).plan({})] == ["todo"] * 3  # in process: no request to name
