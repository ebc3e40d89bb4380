"""Rows planned ahead in processes of their own (`layertap.pipeline.lookahead`, a real forkserver pool) are the rows
the run's process plans: the same samples (ids, tokens, loss masks, truncation) and the same errors (a repeated id,
an unreadable row, a row that gives no sample, one over the input limit), in row order, with Kimi-K2.5's Python
tokenizer; a planning process killed mid-run leaves its rows to the run's process and loses none; a run with
``plan_processes`` stores what a run without stores."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from layertap.data.reader import iter_rows
from layertap.data.scan import scan_dataset
from layertap.errors import OverlongRow, RowError
from layertap.models.folder import ModelFolder
from layertap.pipeline import run_extraction
from layertap.pipeline.lookahead import Lookahead
from layertap.pipeline.rows import RowPlanner, _planner
from layertap.pipeline.steps import Tokenize
from layertap.spec import ExtractionSpec
from layertap.store.store import OutputStore
from layertap.verify import verify_store
from tests.core.datasets import conversation_rows, write_jsonl
from tests.hf_engines import cpu_hf

LIMIT = 96  # tokens: some rows of `rows` are longer


def rows_with_every_outcome(tmp_path):
    rows = conversation_rows(40, seed=3, max_words=30)
    rows[5]["id"] = rows[1]["id"]  # a repeated id
    rows[9] = {"id": "no-answer", "messages": [{"role": "user", "content": "hello?"}]}  # gives no sample
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    data.write_text(data.read_text() + "{not json\n")  # an unreadable row
    return data


def same(a, b) -> bool:
    """Two planned items alike: status, sample (id, tokens, mask, truncation) or error (type, kind, text)."""
    if (a.row, a.status) != (b.row, b.status):
        return False
    if a.sample is not None:
        x, y = a.sample, b.sample
        return (x.sample_id, x.truncated) == (y.sample_id, y.truncated) and torch.equal(x.input_ids, y.input_ids) \
            and torch.equal(x.loss_mask, y.loss_mask)  # fmt: skip
    return (type(a.error), a.error.kind, str(a.error)) == (type(b.error), b.error.kind, str(b.error))


@pytest.mark.parametrize("overlong", ["skip", "truncate"])
def test_rows_planned_ahead_are_the_rows_planned_here(tiny_kimi25, tmp_path, overlong: str) -> None:
    data = rows_with_every_outcome(tmp_path)
    spec = ExtractionSpec(model=tiny_kimi25, data=data, layers=(1,), format="speculators", overlong=overlong,
                          trust_remote_code=True)  # fmt: skip
    folder = ModelFolder.read(tiny_kimi25)
    here = list(RowPlanner(spec, Tokenize(folder, spec, LIMIT), duplicates=scan_dataset(data).duplicates).plan({}))
    errors = [p.error for p in here if p.error is not None]
    assert {e.kind for e in errors} >= {"duplicate_id", "row"} and len(here) == 41 and here[40].error is not None
    assert any(isinstance(e, OverlongRow) for e in errors) == (overlong == "skip")
    assert any(p.sample is not None and p.sample.truncated for p in here) == (overlong == "truncate")

    planner = RowPlanner(spec, Tokenize(folder, spec, LIMIT), duplicates=scan_dataset(data).duplicates)
    make = (_planner, (folder, spec, LIMIT, planner.duplicates, None))
    ahead = Lookahead(planner.outcome, make, processes=2, ahead=8)
    try:
        ahead.warm.result(timeout=300)  # every row then goes to the pool
        planned = [planner._plan_row(row, read, [], outcome) for row, read, outcome in ahead.outcomes(iter_rows(data))]
    finally:
        ahead.close()
    assert ahead.planned == {"ahead": 41, "here": 0}
    assert all(same(a, b) for a, b in zip(here, [item for items in planned for item in items], strict=True))
    # Through the planner itself, however many rows the pool was ready for:
    with_pool = list(RowPlanner(spec, Tokenize(folder, spec, LIMIT), duplicates=scan_dataset(data).duplicates,
                                processes=2).plan({}))  # fmt: skip
    assert all(same(a, b) for a, b in zip(here, with_pool, strict=True))


def test_a_planning_process_killed_leaves_its_rows_to_the_run(tiny_kimi25, tmp_path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(60, seed=4, max_words=30))
    spec = ExtractionSpec(model=tiny_kimi25, data=data, layers=(1,), format="speculators", trust_remote_code=True)
    folder = ModelFolder.read(tiny_kimi25)
    planner = RowPlanner(spec, Tokenize(folder, spec, None))
    here = [planner.outcome(row, read) for row, read in iter_rows(data)]
    ahead = Lookahead(planner.outcome, (_planner, (folder, spec, None, {}, None)), processes=2, ahead=8)
    got = []
    try:
        ahead.warm.result(timeout=300)
        for n, (_, _, outcome) in enumerate(ahead.outcomes(iter_rows(data))):
            got.append(outcome)
            if n == 5:
                os.kill(next(iter(ahead.pool._processes)), signal.SIGKILL)  # the pool breaks
    finally:
        ahead.close()
    assert ahead.planned["ahead"] >= 6 and ahead.planned["here"] > 0 and len(got) == 60
    assert not any(isinstance(o, RowError) for o in got)
    assert all(torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask) and
               a.sample_id == b.sample_id for a, b in zip(here, got, strict=True))  # fmt: skip


def test_a_run_planning_ahead_stores_what_a_run_planning_here_stores(tiny_llama, tmp_path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(12, seed=6, max_words=20))
    spec = ExtractionSpec(model=tiny_llama, data=data, layers=(1, 3, 5))
    stores = {}
    for processes in (0, 2):
        out = tmp_path / f"out-{processes}"
        report = run_extraction(spec, out, cpu_hf(batch_size=4, plan_processes=processes))
        assert len(report.computed) == 12 and verify_store(out).ok
        stores[processes] = OutputStore.open_existing(out).records()
    assert {k: (r.ids_sha256, r.mask_runs, r.sha256) for k, r in stores[0].items()} == {
        k: (r.ids_sha256, r.mask_runs, r.sha256) for k, r in stores[2].items()
    }


def test_a_row_error_pickles_with_its_row_id_and_kind() -> None:
    import pickle

    for err in (RowError("bad", row=3, sample_id="x", kind="duplicate_id"), OverlongRow("long", row=4)):
        back = pickle.loads(pickle.dumps(err))
        assert (type(back), back.row, back.sample_id, back.kind, str(back)) == (
            type(err), err.row, err.sample_id, err.kind, str(err)
        )  # fmt: skip
