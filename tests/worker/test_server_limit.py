"""A job's max_length above the prompt limit of the workers' SGLang servers: before any worker has said its
server's limit the job is accepted and only its longer rows fail, each with its own error (the shard completes);
once a worker has said it, the coordinator refuses such a job at submit, naming both numbers. A run or a job
without max_length keeps its rows within the server's limit, records it in the manifest, and `verify --data` judges
rows by it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from harness.processes import wait_for
from layertap.engines.server_facts import ServerFacts
from layertap.engines.sglang import SGLangEngine
from layertap.engines.sglang.process import SGLangServer
from layertap.models.folder import ModelFolder
from layertap.pipeline import run_extraction
from layertap.spec import CaptureSpec, ExtractionSpec
from layertap.state.shards import input_limit
from layertap.store.manifest import read_manifest
from layertap.verify import verify_store
from tests.core.datasets import conversation_rows, write_jsonl
from tests.worker.conftest import LAYERS

CONTEXT = 512  # the server's --context-length: its prompt limit is a few tokens below
MAX_LENGTH = 1024  # the job's: within the tiny model's context (4096), above the server's limit


@pytest.mark.sglang
def test_a_max_length_above_the_servers_limit_fails_only_the_longer_rows_then_is_refused_at_submit(
    start_cluster, sglang_servers, tiny_llama, tmp_path
) -> None:
    server = sglang_servers(tiny_llama, layers=LAYERS, extra_args=("--context-length", str(CONTEXT)))
    limit = ServerFacts.from_info(server.url, httpx.get(f"{server.url}/server_info", timeout=30).json())
    limit = limit.input_limit
    assert limit is not None and limit < MAX_LENGTH
    rows = conversation_rows(8, seed=4, max_words=18)
    rows[5]["messages"][-1]["content"] = "state " * (limit + 50)  # over the server's limit, within max_length
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    cluster = start_cluster(workers=0)
    cluster.add_worker("w1", LAYERTAP_ENGINE="sglang", LAYERTAP_SERVER_URL=server.url,
                       LAYERTAP_DUMP_ROOT=str(server.dump_root))  # fmt: skip
    assert input_limit(cluster.state, cluster.keys, str(tiny_llama)) is None  # no worker has attached yet

    # Accepted (the limit is not known yet): the shard completes, the one longer row is its error.
    job_id = cluster.submit(tiny_llama, data, max_length=MAX_LENGTH, max_bad_rows="1")
    job = cluster.wait_state(job_id, "done")
    with cluster.api() as api:
        errors = api.get(f"/jobs/{job_id}/errors").json()["errors"]
    assert [(e["row"], e["kind"]) for e in errors] == [(5, "input_limit")], errors
    assert f"more than the {limit} the SGLang server accepts" in errors[0]["reason"]
    assert f"max_length {MAX_LENGTH} is above its limit" in errors[0]["reason"]
    check = verify_store(Path(job["out"]))
    assert check.ok and check.samples == len(rows) - 1, check.problems

    # The worker said its server's limit when it attached: the same job is refused, and nothing is created.
    assert input_limit(cluster.state, cluster.keys, str(tiny_llama)) == limit
    folders = sorted(cluster.output_root.iterdir())
    body = {"model": str(tiny_llama), "data": str(data), "layers": list(LAYERS), "max_length": MAX_LENGTH}
    with cluster.api() as api:
        refused = api.post("/jobs", json=body)
        assert refused.status_code == 422, refused.text
        detail = refused.json()["detail"]
        assert f"max_length {MAX_LENGTH} is above" in detail and f"({limit} tokens" in detail, detail
        assert sorted(cluster.output_root.iterdir()) == folders
        accepted = api.post("/jobs", json=body | {"max_length": limit})  # at the limit: accepted
        assert accepted.status_code == 201, accepted.text
        api.post(f"/jobs/{accepted.json()['job_id']}/cancel")

    # A job without max_length: the worker keeps its rows within its server's limit, and its manifest says so.
    unbounded = cluster.wait_state(cluster.submit(tiny_llama, data), "done")
    manifest = read_manifest(Path(unbounded["out"]))
    assert (manifest.input_limit, manifest.max_length) == (limit, None)
    assert verify_store(Path(unbounded["out"]), data=data).ok  # row 5 truncated at it, judged by it

    # A worker counts while it lives: once its record has expired, no limit is known and the job is accepted.
    cluster.workers["w1"].kill()
    wait_for(lambda: input_limit(cluster.state, cluster.keys, str(tiny_llama)) is None, timeout=30,
             what="the killed worker's record to expire")  # fmt: skip
    with cluster.api() as api:
        assert api.post("/jobs", json=body).status_code == 201


@pytest.mark.sglang
def test_a_run_records_the_servers_limit_as_its_input_limit_and_verify_judges_rows_by_it(
    sglang_servers, tiny_llama, tmp_path
) -> None:
    server = sglang_servers(tiny_llama, layers=LAYERS, extra_args=("--context-length", str(CONTEXT)))
    rows = conversation_rows(6, seed=8, max_words=18)
    long = "state " * (CONTEXT + 50)  # over the server's limit, within the model's context (4096)
    rows[2]["messages"][-1]["content"] = long
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    spec = ExtractionSpec(model=tiny_llama, data=data, layers=LAYERS, overlong="skip")  # no max_length

    def engine(capture: CaptureSpec, folder: ModelFolder) -> SGLangEngine:
        return SGLangEngine(SGLangServer(url=server.url), capture, folder=folder, dump_root=server.dump_root,
                            job="limit", in_flight=4)  # fmt: skip

    out = tmp_path / "out"
    first = run_extraction(spec, out, engine)
    limit = ServerFacts.from_info(server.url, httpx.get(f"{server.url}/server_info", timeout=30).json()).input_limit
    assert limit is not None and limit < CONTEXT
    assert (read_manifest(out).input_limit, read_manifest(out).max_length) == (limit, None)
    assert first.skipped_overlong == 1 and len(first.computed) == len(rows) - 1

    rows[4]["messages"][-1]["content"] = long  # a stored row grown past the limit: the run would skip it now
    write_jsonl(data, rows)
    check = verify_store(out, data=data)
    assert len(check.problems) == 1 and "(conv-4): row 4 of" in check.problems[0], check.problems
    assert "no longer gives a sample: longer than max_length (" in check.problems[0]
    assert f" > {limit} tokens)" in check.problems[0]

    resumed = run_extraction(spec, out, engine)  # what verify said is what the resume retires
    assert resumed.changed == ["conv-4"] and resumed.skipped_overlong == 2 and resumed.computed == []  # rows 2, 4
    assert verify_store(out, data=data).ok
