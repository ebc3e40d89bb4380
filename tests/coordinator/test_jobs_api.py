"""``/jobs`` over HTTP: validation before anything is enqueued, planning, progress, cancel/resume, auth."""

import shutil
from pathlib import Path

import pytest

from layertap.state.keys import SHARD_QUEUE, Keys


def job_body(model: Path, data: Path, **extra) -> dict:
    return {"model": str(model), "data": str(data), "layers": [1, 3, 5], "shard_size": 10, **extra}


def nothing_enqueued(redis_client, tmp_path: Path) -> bool:
    return (
        redis_client.llen(SHARD_QUEUE) == 0
        and not redis_client.keys("layertap:*")
        and not any((tmp_path / "outputs").glob("*"))
    )


def test_submit_plans_shards_creates_the_store_and_enqueues_one_task_per_shard(
    api, tiny_llama, dataset, redis_client, tmp_path
) -> None:
    reply = api.post("/jobs", json=job_body(tiny_llama, dataset, out="runs/first"))
    assert reply.status_code == 201, reply.text
    job = reply.json()
    assert job["state"] == "running" and job["samples_total"] == 45 and job["num_shards"] == 5
    assert job["shards"] == {"queued": 5} and job["samples_done"] == 0 and job["eta_s"] is None
    assert job["out"] == str((tmp_path / "outputs" / "runs" / "first").resolve())
    assert (Path(job["out"]) / "manifest.json").exists() and (Path(job["out"]) / "job.json").exists()
    assert redis_client.llen(SHARD_QUEUE) == 5

    assert api.get(f"/jobs/{job['job_id']}").json()["num_shards"] == 5
    listed = api.get("/jobs").json()
    assert listed["count"] == 1 and listed["jobs"][0]["job_id"] == job["job_id"]
    assert api.get(f"/jobs/{job['job_id']}/errors").json() == {"job_id": job["job_id"], "count": 0, "errors": []}
    assert api.get("/jobs/nope").status_code == 404
    assert api.get("/jobs/nope/errors").status_code == 404


@pytest.mark.parametrize(
    ("change", "detail"),
    [
        ({"layers": [1, 9]}, "outside [1, 5]"),
        ({"out": "../../escape"}, "outside the output root"),
        ({"data": "/no/such/data.jsonl"}, "dataset not found"),
        ({"model": "models/tiny"}, "model must be an absolute path"),
        ({"format": "speculators", "final": "post"}, "speculators"),
        ({"shard_size": 0}, "greater than 0"),
        ({"layer_ids": [1]}, "Extra inputs are not permitted"),
        ({"engine": {"in_flight": 0}}, "greater than 0"),
        ({"max_length": 4097}, "max_length 4097 is above the context length of "),  # the tiny Llama's is 4096
        ({"max_length": 8192}, "(4096, max_position_embeddings in config.json): give at most 4096"),
        ({"max_bad_rows": "5 percent"}, "max_bad_rows must be a count (e.g. 100) or a share of the rows (e.g. 5%)"),
        ({"max_bad_rows": -1}, "got '-1'"),
        ({"audit_samples": -1}, "greater than or equal to 0"),
    ],
)
def test_a_bad_spec_gets_422_with_a_precise_message_and_nothing_is_enqueued(
    api, tiny_llama, dataset, redis_client, tmp_path, change, detail
) -> None:
    reply = api.post("/jobs", json=job_body(tiny_llama, dataset) | change)
    assert reply.status_code == 422, reply.text
    assert detail in str(reply.json()["detail"])
    assert nothing_enqueued(redis_client, tmp_path)


def test_an_unreadable_dataset_is_rejected_before_anything_is_enqueued(api, tiny_llama, redis_client, tmp_path) -> None:
    for name, content, detail in [
        ("rows.csv", "a,b\n1,2\n", "unknown dataset format"),
        ("broken.parquet", "not parquet", "not a readable Parquet file"),
        ("empty.jsonl", "\n\n", "has no rows"),
        ("damaged.jsonl.gz", "\x1f\x8b\x08 not really gzip", "damaged.jsonl.gz"),
    ]:
        path = tmp_path / name
        path.write_bytes(content.encode("latin-1"))
        reply = api.post("/jobs", json=job_body(tiny_llama, path))
        assert reply.status_code == 422 and detail in reply.json()["detail"], reply.text
    assert nothing_enqueued(redis_client, tmp_path)


def test_remote_code_is_refused_unless_the_operator_allowed_it(
    make_api, tiny_kimi25, dataset, redis_client, tmp_path
) -> None:
    closed = make_api()
    reply = closed.post("/jobs", json=job_body(tiny_kimi25, dataset, trust_remote_code=True))
    assert reply.status_code == 403 and "LAYERTAP_ALLOW_REMOTE_CODE" in reply.json()["detail"], reply.text
    # A folder whose tokenizer is code, without trust_remote_code: refused naming the flag and the file.
    reply = closed.post("/jobs", json=job_body(tiny_kimi25, dataset))
    assert reply.status_code == 422 and "tokenization_tiny_kimi.py" in reply.json()["detail"], reply.text
    assert nothing_enqueued(redis_client, tmp_path)
    opened = make_api(allow_remote_code=True)
    reply = opened.post("/jobs", json=job_body(tiny_kimi25, dataset, trust_remote_code=True, layers=[1, 2, 4]))
    assert reply.status_code == 201, reply.text
    assert reply.json()["num_shards"] == 5


def test_a_model_or_dataset_outside_the_operators_roots_is_forbidden(
    make_api, tiny_llama, dataset, redis_client, tmp_path
) -> None:
    models, data = tmp_path / "models", tmp_path / "data"
    shutil.copytree(tiny_llama, models / "tiny")
    data.mkdir()
    rows = Path(shutil.copy(dataset, data / "rows.jsonl"))
    (models / "link").symlink_to(tiny_llama)  # inside the model root, to a folder outside it
    api = make_api(model_root=models, data_root=data)
    outside = [
        ({"model": str(tiny_llama)}, f"outside this coordinator's model root {models} (LAYERTAP_MODEL_ROOT)"),
        ({"model": f"{models}/../data"}, f"resolves to {data}, outside"),
        ({"model": str(models / "link")}, f"resolves to {tiny_llama}, outside"),
        # ".." after a link climbs from where the link points, as the workers' reads would: not back into models/
        ({"model": f"{models}/link/../tiny"}, f"resolves to {tiny_llama.parent / 'tiny'}, outside"),
        ({"data": str(dataset)}, f"outside this coordinator's data root {data} (LAYERTAP_DATA_ROOT)"),
        ({"data": f"{data}/../data.jsonl"}, f"resolves to {dataset}, outside"),
    ]
    for change, detail in outside:
        reply = api.post("/jobs", json=job_body(models / "tiny", rows) | change)
        assert reply.status_code == 403 and detail in reply.json()["detail"], (change, reply.text)
    assert nothing_enqueued(redis_client, tmp_path)
    # Inside both roots, written with a detour that resolves back into them: accepted.
    assert api.post("/jobs", json=job_body(models / "tiny" / ".." / "tiny", rows)).status_code == 201


def test_an_output_folder_of_another_job_is_a_conflict(api, tiny_llama, dataset) -> None:
    first = api.post("/jobs", json=job_body(tiny_llama, dataset, out="shared")).json()
    again = api.post("/jobs", json=job_body(tiny_llama, dataset, out="shared"))
    assert again.status_code == 409 and f"already belongs to job {first['job_id']}" in again.json()["detail"]


def test_cancel_then_resume_sends_every_unfinished_shard_again(api, tiny_llama, dataset, redis_client) -> None:
    job_id = api.post("/jobs", json=job_body(tiny_llama, dataset)).json()["job_id"]
    keys = Keys()
    first_tokens = {redis_client.hget(keys.shard(job_id, n), "token") for n in range(5)}
    cancelled = api.post(f"/jobs/{job_id}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"

    resumed = api.post(f"/jobs/{job_id}/resume").json()
    assert resumed["state"] == "running" and resumed["shards"] == {"queued": 5}
    new_tokens = {redis_client.hget(keys.shard(job_id, n), "token") for n in range(5)}
    assert not first_tokens & new_tokens  # the old messages are now stale
    assert redis_client.llen(SHARD_QUEUE) == 10
    assert api.post("/jobs/nope/resume").status_code == 404
    assert api.post("/jobs/nope/cancel").status_code == 404


def test_with_a_token_every_endpoint_but_health_needs_it(make_api, tiny_llama, dataset) -> None:
    api = make_api(token="s3cret")
    assert api.get("/health").json() == {"status": "ok"}
    calls = [("post", "/jobs"), ("get", "/jobs"), ("get", "/jobs/x"), ("get", "/jobs/x/errors"),
             ("post", "/jobs/x/cancel"), ("post", "/jobs/x/resume")]  # fmt: skip
    for method, path in calls:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            reply = api.request(method, path, headers=headers, json=job_body(tiny_llama, dataset))
            assert reply.status_code == 401, (method, path, headers)
    good = {"Authorization": "Bearer s3cret"}
    assert api.post("/jobs", headers=good, json=job_body(tiny_llama, dataset)).status_code == 201
    assert api.get("/jobs", headers=good).json()["count"] == 1


def test_openapi_docs_are_served(api) -> None:
    schema = api.get("/openapi.json").json()
    assert {
        "/jobs",
        "/jobs/{job_id}",
        "/jobs/{job_id}/errors",
        "/jobs/{job_id}/cancel",
        "/jobs/{job_id}/resume",
    } <= set(schema["paths"])
    assert "shard_size" in schema["components"]["schemas"]["JobCreate"]["properties"]
    assert api.get("/docs").status_code == 200


def test_a_specforge_job_with_2_aux_layers_is_refused_unless_the_spec_allows_any_count(
    api, tiny_llama, dataset
) -> None:
    refused = api.post("/jobs", json=job_body(tiny_llama, dataset, layers=[1, 3]))
    assert refused.status_code == 422 and "takes exactly 3" in refused.json()["detail"], refused.text
    allowed = api.post("/jobs", json=job_body(tiny_llama, dataset, layers=[1, 3], allow_any_aux_layers=True))
    assert allowed.status_code == 201, allowed.text


def test_a_job_says_what_it_stores_per_token_and_fp8_is_for_speculators_only(
    api, tiny_llama, dataset, redis_client, tmp_path
) -> None:
    """The status page's bytes: tokens done x the store's bytes per token, in its store dtype (hidden 64, 3 aux
    layers + the final: bf16 2 bytes a value; FP8 1 byte and a 4-byte scale per state; ids and mask 16)."""
    jobs = {}
    for dtype in ("bfloat16", "fp8"):
        reply = api.post("/jobs", json=job_body(tiny_llama, dataset, format="speculators", store_dtype=dtype))
        assert reply.status_code == 201, reply.text
        jobs[dtype] = api.get(f"/jobs/{reply.json()['job_id']}").json()
    assert (jobs["bfloat16"]["store_dtype"], jobs["bfloat16"]["bytes_per_token"]) == ("bfloat16", 4 * 2 * 64 + 16)
    assert (jobs["fp8"]["store_dtype"], jobs["fp8"]["bytes_per_token"]) == ("fp8", 4 * (64 + 4) + 16)
    assert jobs["fp8"]["bytes_done_estimate"] == 0  # nothing done yet
    refused = api.post("/jobs", json=job_body(tiny_llama, dataset, store_dtype="fp8"))  # specforge
    assert refused.status_code == 422 and "SpecForge 0.2.0 reads no FP8" in refused.text
