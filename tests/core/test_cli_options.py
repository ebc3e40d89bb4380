"""A run's options are defined once: ``extract`` and ``submit`` take the extraction spec's options alike, every option
of theirs is a field of the models they are made from, and a worker runs with ``extract``'s defaults."""

from __future__ import annotations

from typing import Any

import click
import pytest
from click.testing import CliRunner

from layertap.cli import extract
from layertap.cli_jobs import submit
from layertap.settings import RunSettings
from layertap.spec import ExtractionSpec
from layertap.state.model import JobRequest
from worker.config import WorkerSettings

SPEC_FIELDS = set(ExtractionSpec.model_fields)
EXTRACT_OWN = {"out"}  # the local store's folder (a job's is JobSpec.out, relative to the coordinator's root)
SUBMIT_OWN = {"wait", "api", "token"}  # how the client talks to the coordinator, not part of the job


def options(command: click.Command) -> dict[str, dict[str, Any]]:
    """Each option of ``command`` as click describes it: flags, type and choices, default, required, help."""
    return {p.name: p.to_info_dict() for p in command.params if isinstance(p, click.Option) and p.name != "help"}


def flattened_fields(model: type) -> set[str]:
    names = set()
    for name, info in model.model_fields.items():
        nested = getattr(info.annotation, "model_fields", None)
        names |= flattened_fields(info.annotation) if nested else {name}
    return names


def test_extract_and_submit_take_the_spec_options_alike() -> None:
    ext, sub = options(extract), options(submit)
    assert set(ext) >= SPEC_FIELDS and set(sub) >= SPEC_FIELDS
    differ = {name: (ext[name], sub[name]) for name in sorted(SPEC_FIELDS) if ext[name] != sub[name]}
    assert differ == {}


def test_every_option_is_a_field_of_the_models_the_command_is_made_from() -> None:
    """An option written by hand into one command (or a field no command takes) shows up here."""
    assert set(options(extract)) == SPEC_FIELDS | set(RunSettings.model_fields) | EXTRACT_OWN
    assert set(options(submit)) == flattened_fields(JobRequest) | SUBMIT_OWN


def test_a_worker_runs_with_extracts_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine, commit and resume setting a worker shares with ``extract`` (``in_flight`` included) has the
    CLI's default when its LAYERTAP_ variable is unset."""
    for name in WorkerSettings.model_fields:
        monkeypatch.delenv(f"LAYERTAP_{name.upper()}", raising=False)
    worker = WorkerSettings(redis_url="redis://127.0.0.1:1")
    shared = set(options(extract)) & set(WorkerSettings.model_fields)
    assert {"in_flight", "device", "batch_tokens", "sglang_args", "resume_check", "commit_threads"} <= shared
    ext = options(extract)
    assert {name: ext[name]["default"] for name in shared} == {name: getattr(worker, name) for name in shared}


@pytest.mark.parametrize("command", [extract, submit])
def test_a_required_option_left_out_is_named_by_click(command: click.Command, tmp_path) -> None:
    """A required field's option left out is click's usage error naming it (exit 2), not the model's complaint
    about a None it was handed ("--layers: Input should be a valid tuple", click 8.3 and later)."""
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    args = ["--model", str(tmp_path), "--data", str(data), "--out", str(tmp_path / "out")]
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 2, result.output
    assert "Missing option '--layers'" in result.output
