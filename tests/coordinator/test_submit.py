"""``layertap submit`` sends the job model's dump: every field of ``JobRequest``, given on the command line, reaches a
real coordinator (uvicorn, the session's Redis) and is what it stores for the job."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from layertap.cli_jobs import submit, wait_exit
from layertap.settings import JOB_TUNABLE
from layertap.state.model import JOB_FILE, JobRequest, JobSpec
from tests.core.datasets import conversation_rows, write_jsonl

# A value other than the default for every option of the job (engine options flattened, as submit takes them).
GIVEN: dict[str, Any] = {
    "layers": [0, 2, 4],
    "layer_convention": "sglang-eagle3",
    "final": "pre",
    "format": "speculators",
    "store_dtype": "fp8",
    "max_length": 512,
    "overlong": "skip",
    "chat_template_kwargs": {"thinking": False, "mode": "x"},
    "trust_remote_code": True,
    "allow_any_aux_layers": True,
    "max_bad_rows": "7",
    "out": "body",
    "shard_size": 7,
    "batch_tokens": 1024,
    "batch_size": 2,
    "in_flight": 3,
    "generation_in_flight": 5,
    "sample_attempts": 5,
    "audit_samples": 2,
    "regenerate": "last",
    "max_new_tokens": 64,
    "temperature": 0.5,
    "top_p": 0.9,
    "seed": 7,
    "drop_truncated": True,
    "stream": "mooncake",
    "stream_only": True,
    "mooncake_master": "10.0.0.7:50051",
    "stream_redis_url": "redis://10.0.0.7:6379/2",
    "stream_name": "given",
    "stream_unacked": 9,
    "expected_tokens": 1000,
}
ENGINE = JOB_TUNABLE


def argv(values: dict[str, Any]) -> list[str]:
    """``values`` as submit's flags (each option's own flag name, read from the command)."""
    flags = {p.name: p.opts[0] for p in submit.params}
    args: list[str] = []
    for name, value in values.items():
        if value is True:
            args.append(flags[name])
        elif isinstance(value, dict):
            args += [flags[name], json.dumps(value)]
        else:
            args += [flags[name], ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return args


def test_submit_sends_every_field_of_the_job_and_the_coordinator_stores_it(
    services, redis_server, redis_client, tiny_llama: Path, tmp_path: Path
) -> None:
    fields = set(JobRequest.model_fields) - {"model", "data", "engine"} | set(ENGINE)
    assert set(GIVEN) == fields, "give every field of the job a value other than its default"
    defaults = {name: JobRequest.model_fields[name].default for name in fields - set(ENGINE)} | dict.fromkeys(ENGINE)
    assert [name for name in GIVEN if GIVEN[name] == defaults[name]] == []
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(20, seed=3))
    root = tmp_path / "outputs"
    coordinator = services.coordinator(redis_server.url, root, LAYERTAP_ALLOW_REMOTE_CODE="1")
    common = ["--api", coordinator.url, "--model", str(tiny_llama), "--data", str(data)]

    sent = CliRunner().invoke(submit, [*common, *argv(GIVEN)])
    assert sent.exit_code == 0, sent.output
    job_id = sent.stdout.strip()
    stored = json.loads((root / "body" / JOB_FILE).read_text())
    assert stored["job_id"] == job_id
    engine = {name: GIVEN[name] for name in ENGINE}
    rest = {name: value for name, value in GIVEN.items() if name not in ENGINE}
    asked = JobRequest(model=tiny_llama.resolve(), data=data.resolve(), engine=engine, **rest)
    expected = JobSpec(**asked.model_dump(exclude={"expected_tokens", "out"}), out=(root / "body").resolve())
    assert JobSpec.model_validate(stored["spec"]) == expected
    # the manifest, planned with the job, records the template variables its rows are rendered with
    assert json.loads((root / "body" / "manifest.json").read_text())["chat_template_kwargs"] == {
        "thinking": False, "mode": "x"}  # fmt: skip

    # expected_tokens is not stored: it is checked, so a corpus too large for the volume is refused (507), unless the
    # job writes no states (stream-only: its samples go to the stream)
    files = {name: value for name, value in GIVEN.items() if name != "stream_only"}
    refused = CliRunner().invoke(submit, [*common, *argv({**files, "out": "big", "expected_tokens": 10**15})])
    assert refused.exit_code == 2 and "507" in refused.output, refused.output
    streamed = CliRunner().invoke(submit, [*common, *argv({**GIVEN, "out": "big-stream", "expected_tokens": 10**15})])
    assert streamed.exit_code == 0, streamed.output


@pytest.mark.parametrize(
    ("state", "audit", "status"),
    [
        ("done", None, 0),
        ("done", "pass", 0),
        ("done", "fail", 1),
        ("done", "inconclusive", 3),  # as `layertap audit` exits on the same verdict (docs/cli.md)
        ("done", "error", 1),  # the audit could not run
        ("failed", None, 1),
        ("failed", "pass", 1),
        ("cancelled", None, 1),
    ],
)
def test_submit_wait_exits_on_the_job_state_then_its_audit_verdict(state: str, audit: str | None, status: int) -> None:
    job = {"state": state, "audit": None if audit is None else {"state": audit}}
    assert wait_exit(job) == status
