"""Jobs with bad input or a broken model, on real services: failures are reported, never block the rest."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from layertap.pipeline import run_extraction
from layertap.spec import ExtractionSpec
from layertap.state.plan import plan_shards
from layertap.store.store import OutputStore
from layertap.verify import verify_store
from sglang_patch.identity import model_identity
from tests.core.datasets import conversation_rows, malformed_dataset, strict_template_model, write_jsonl
from tests.hf_engines import cpu_hf
from tests.worker.conftest import LAYERS, NUM_SAMPLES, SHARD_SIZE, check_output, layertap

POISON_TOKEN = 1534  # "ĠFibonacci" in the tiny tokenizer: never produced from the conversation words


@pytest.fixture
def poisoned_llama(tiny_llama: Path, tmp_path: Path) -> Path:
    """The tiny Llama with one embedding row set to NaN: any sample holding that token has non-finite states."""
    model = tmp_path / "poisoned-llama"
    shutil.copytree(tiny_llama, model)
    weights = load_file(model / "model.safetensors")
    weights["model.embed_tokens.weight"][POISON_TOKEN] = torch.nan
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    return model


def test_bad_rows_and_poison_samples_are_reported_and_everything_else_is_done(
    start_cluster, poisoned_llama, tmp_path
) -> None:
    rows = conversation_rows(60, seed=9, max_words=18)
    rows[17] = {"id": "no-assistant", "messages": [{"role": "user", "content": "anyone there?"}]}
    rows[30] = {
        "id": "bad-role",
        "messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "yo"}],
    }
    for i in (41, 52):
        rows[i] = {"id": f"poison-{i}", "input_ids": [1, 40, POISON_TOKEN, 50, 60, 70], "loss_mask": [0, 0, 1, 1, 1, 1]}
    # File line 5 is not JSON: every later row number shifts by one (61 rows in all).
    data = write_jsonl(tmp_path / "data.jsonl", rows, raw_lines={5: '{"id": "broken", "messages": ['})
    cluster = start_cluster()
    job_id = cluster.submit(poisoned_llama, data, sample_attempts=3, engine={"batch_size": 4}, max_bad_rows="5")

    job = cluster.wait_state(job_id, "done")
    assert (job["samples_total"], job["samples_done"], job["samples_failed"]) == (61, 56, 5)
    with cluster.api() as api:
        errors = {e["row"]: e for e in api.get(f"/jobs/{job_id}/errors").json()["errors"]}
    assert {row: e["kind"] for row, e in errors.items()} == {
        5: "row",
        18: "row",
        31: "row",
        42: "capture",
        53: "capture",
    }
    assert "malformed JSON" in errors[5]["reason"] and errors[18]["sample_id"] == "no-assistant"
    assert "wizard" in errors[31]["reason"]
    for row in (42, 53):
        assert "non-finite" in errors[row]["reason"] and "failed all 3 attempts" in errors[row]["reason"]
    # The API's view is the store's own error log.
    out = Path(job["out"])
    assert {e["row"]: e["kind"] for e in OutputStore.open_existing(out).errors()} == {
        row: e["kind"] for row, e in errors.items()
    }
    report = verify_store(out)
    assert report.ok and report.complete and report.samples == 56, report.problems


def test_every_kind_of_bad_row_through_two_workers_gives_what_one_process_gives(
    start_cluster, tiny_llama, tmp_path
) -> None:
    """Shards of 4 rows: the duplicate at row 8 has its first at row 0, in another shard (and worker)."""
    model = strict_template_model(tiny_llama, tmp_path / "model")
    bad = malformed_dataset(tmp_path / "data.jsonl")
    limits = {"max_length": bad.max_length, "overlong": "skip"}
    alone = tmp_path / "alone"
    spec = ExtractionSpec(model=model, data=bad.data, layers=LAYERS, **limits)
    run_extraction(spec, alone, cpu_hf(batch_size=1))
    one = OutputStore.open_existing(alone)

    cluster = start_cluster()
    job_id = cluster.submit(model, bad.data, shard_size=4, **limits)
    # Every shard is done and the store complete, but far more rows are bad than the default 1%: the job failed,
    # saying so with the counts by kind and the most frequent causes.
    job = cluster.wait_state(job_id, "failed")
    assert (job["samples_done"], job["samples_failed"]) == (len(bad.good), len(bad.kinds))
    assert job["shards"] == {"done": 6}
    assert job["error"].startswith(f"{len(bad.kinds) - 1} bad rows of {len(bad.kinds) + len(bad.good)} (")
    assert (
        "over the limit max_bad_rows=1% (0 rows); by kind: row 11, encoding 2, duplicate_id 1, template 1"
        in (job["error"])
    )
    many = OutputStore.open_existing(Path(job["out"]))
    assert {sid: r.sha256 for sid, r in many.records().items()} == {sid: r.sha256 for sid, r in one.records().items()}
    assert {sid: r.index for sid, r in many.records().items()} == bad.good
    kinds = {e["row"]: e["kind"] for e in many.errors()}
    assert kinds == {e["row"]: e["kind"] for e in one.errors()} == bad.kinds
    with cluster.api() as api:
        listed = api.get(f"/jobs/{job_id}/errors").json()["errors"]
    assert {e["row"]: e["kind"] for e in listed} == bad.kinds
    assert verify_store(Path(job["out"])).ok


def test_a_model_no_worker_can_load_fails_the_job_after_retries_and_resume_completes_it(
    start_cluster, services, tiny_llama, corpus, reference, tmp_path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    weights = model / "model.safetensors"
    good = weights.read_bytes()
    cluster = start_cluster(workers=0)
    for name in ("w1", "w2"):
        cluster.add_worker(name, LAYERTAP_TASK_MAX_RETRIES="2")
    weights.write_bytes(b"truncated")  # planning reads config.json only: the job is accepted
    job_id = cluster.submit(model, corpus)

    job = cluster.wait_state(job_id, "failed")
    assert job["shards"] == {"failed": NUM_SAMPLES // 25} and job["samples_done"] == 0
    assert f"cannot load the hf engine for {model}" in job["error"] and "SafetensorError" in job["error"]
    shard = cluster.shards(job_id)[0]
    assert int(shard["attempts"]) == 3  # the first try and two retries with backoff

    weights.write_bytes(good)  # the operator fixes the model
    with cluster.api() as api:
        assert api.post(f"/jobs/{job_id}/resume").json()["state"] == "running"
    job = cluster.wait_state(job_id, "done")
    check_output(Path(job["out"]), reference)


def test_after_redis_lost_everything_rebuild_state_resumes_the_job(
    start_cluster, services, redis_server, tiny_llama, corpus, reference
) -> None:
    cluster = start_cluster()
    job_id = cluster.submit(tiny_llama, corpus)
    cluster.freeze_mid_shard(job_id, all_workers=True)
    out = Path(cluster.job(job_id)["out"])
    services.stop_all()  # every process goes down ...
    state = cluster.state
    state.flushall()  # ... and Redis comes back empty
    assert not state.keys("*")

    rebuilt = layertap("rebuild-state", str(out), env={"LAYERTAP_REDIS_URL": redis_server.url})
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert rebuilt.stdout.strip() == job_id and "shards done" in rebuilt.stderr
    committed = len(OutputStore.open_existing(out).records())
    assert 0 < cluster.samples_done(job_id) == committed < NUM_SAMPLES

    cluster.workers = {}
    cluster.restart_coordinator()
    cluster.add_worker("w1")
    cluster.add_worker("w2")
    cluster.wait_state(job_id, "done")
    check_output(out, reference)


@pytest.mark.sglang
def test_a_job_through_the_cpu_sglang_server_completes_exactly_once(
    start_cluster, sglang_llama, tiny_llama, corpus, reference, reference_store
) -> None:
    """The same job with both workers attached to one CPU SGLang capture server (float32).

    Every sample present once, verify clean, and the stored states equal the HF reference's to
    within one bf16 rounding step (different kernels, so not byte for byte).
    """
    cluster = start_cluster(workers=0)
    engine_env = {"LAYERTAP_ENGINE": "sglang", "LAYERTAP_SERVER_URL": sglang_llama.url,
                  "LAYERTAP_DUMP_ROOT": str(sglang_llama.dump_root)}  # fmt: skip
    cluster.add_worker("w1", **engine_env)
    cluster.add_worker("w2", **engine_env)
    job_id = cluster.submit(tiny_llama, corpus)
    job = cluster.wait_state(job_id, "done")
    report = verify_store(Path(job["out"]))
    assert report.ok and report.samples == len(reference), report.problems
    got, want = OutputStore.open_existing(Path(job["out"])), OutputStore.open_existing(reference_store)
    records, expected = got.records(), want.records()
    assert set(records) == set(reference)
    # The manifest says which worker's server made which shard: every shard's rows, each from w1 or w2's server.
    servers = json.loads((Path(job["out"]) / "manifest.json").read_text())["servers"]
    assert {tuple(s["rows"]) for s in servers} == set(plan_shards(len(reference), SHARD_SIZE))
    assert {s["writer"].split("-")[0] for s in servers} <= {"w1", "w2"}
    assert {json.dumps(s["engine"]["server"]["model"]) for s in servers} == {json.dumps(model_identity(tiny_llama))}
    for sample_id, rec in records.items():
        a, b = got.format.load(got.root / rec.file), want.format.load(want.root / expected[sample_id].file)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for key in ("hidden_state", "aux_hidden_state"):
            torch.testing.assert_close(a[key].float(), b[key].float(), rtol=1.6e-2, atol=1e-2, msg=sample_id)
