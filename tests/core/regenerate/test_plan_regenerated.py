"""The row planner under ``regenerate`` (no server: stored regenerated rows written by hand): a todo row is a `RowJob`
(refused rows are errors), and a committed record is ``done`` only while its stored regenerated row answers the
row's given turns as they are now and re-tokenizes to the record; otherwise it is ``changed``."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from layertap.models.folder import ModelFolder
from layertap.pipeline.rows import RowPlanner
from layertap.pipeline.steps import Tokenize
from layertap.regenerate import RowJob, stored_conversation
from layertap.spec import ExtractionSpec
from layertap.store.index import SampleRecord
from sglang_patch.sample_files import ids_sha256, mask_runs

ROW = {"id": "a", "messages": [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And a fruit?"},
    {"role": "assistant", "content": "Pear."},
]}  # fmt: skip
STORED = {"id": "a", "messages": [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And a fruit?"},
    {"role": "assistant", "content": "A ripe green pear.", "finish_reason": "stop"},
]}  # fmt: skip


def planner(tiny_llama: Path, data: Path, rows: list[dict], stored: dict | None) -> RowPlanner:
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = ExtractionSpec(model=tiny_llama, data=data, layers=(1, 2, 4), regenerate="last")
    tokenize = Tokenize(ModelFolder.read(tiny_llama), spec, spec.max_length)
    return RowPlanner(spec, tokenize, regenerated={"a": stored} if stored else None)


def record_of(plan: RowPlanner, stored: dict) -> SampleRecord:
    conversation, turns, _ = stored_conversation(stored)
    sample = plan.tokenize(0, "a", conversation, turns)
    return SampleRecord("a", 0, sample.num_tokens, "f", 1, "x", ids_sha256(sample.input_ids),
                        mask_runs(sample.loss_mask))  # fmt: skip


def statuses(plan: RowPlanner, records: dict[str, SampleRecord]) -> list[str]:
    return [p.status for p in plan.plan(records)]


def test_todo_rows_are_jobs_and_rows_without_turns_are_errors(tiny_llama: Path, tmp_path: Path) -> None:
    plan = planner(tiny_llama, tmp_path / "d.jsonl", [ROW, {"id": "t", "text": "x"}], None)
    first, second = plan.plan({})
    assert first.status == "todo" and isinstance(first.job, RowJob) and first.sample is None
    assert second.status == "error" and second.error is not None and second.error.kind == "regenerate"


def test_loss_mask_is_on_the_regenerated_turn_only(tiny_llama: Path, tmp_path: Path) -> None:
    plan = planner(tiny_llama, tmp_path / "d.jsonl", [ROW], STORED)
    conversation, turns, _ = stored_conversation(STORED)
    last_only = plan.tokenize(0, "a", conversation, turns)
    every = plan.tokenize(0, "a", conversation, [1, 3])
    assert torch.equal(last_only.input_ids, every.input_ids)
    assert 0 < int(last_only.loss_mask.sum()) < int(every.loss_mask.sum())
    assert bool((last_only.loss_mask <= every.loss_mask).all())
    assert every.loss_mask.tolist().index(1) < last_only.loss_mask.tolist().index(1)  # the given turn is not trained on


def test_done_only_while_the_stored_row_answers_the_row(tiny_llama: Path, tmp_path: Path) -> None:
    plan = planner(tiny_llama, tmp_path / "d.jsonl", [ROW], STORED)
    rec = record_of(plan, STORED)
    assert statuses(plan, {"a": rec}) == ["done"]
    assert statuses(planner(tiny_llama, tmp_path / "d.jsonl", [ROW], None), {"a": rec}) == ["changed", "todo"]
    edited = copy.deepcopy(ROW)
    edited["messages"][2]["content"] = "And a vegetable?"  # a given turn changed: the stored answer is stale
    assert statuses(planner(tiny_llama, tmp_path / "d.jsonl", [edited], STORED), {"a": rec}) == ["changed", "todo"]
    other = copy.deepcopy(STORED)
    other["messages"][3]["content"] = "Plum."  # the record is not this stored row's text
    assert statuses(planner(tiny_llama, tmp_path / "d.jsonl", [ROW], other), {"a": rec}) == ["changed", "todo"]
