"""``/metrics``, ``/workers``, the status page's files and the disk budget, on the in-process app over a real Redis.

Progress is made through the same state functions a worker calls (claim, start, sample_done,
publish_worker), so what the metrics read is what a real worker would have written.
"""

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from layertap.diskspace import bytes_per_token, free_bytes
from layertap.models.folder import model_dims
from layertap.spec import ExtractionSpec
from layertap.state.keys import SHARD_QUEUE, Keys
from layertap.state.shards import ShardAttempt, publish_worker
from tests.coordinator.test_jobs_api import job_body, nothing_enqueued

KEYS = Keys()


def scrape(api) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from GET /metrics."""
    reply = api.get("/metrics")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(reply.text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_metrics_follow_a_job_from_submit_through_worker_progress(
    make_api, tiny_llama, dataset, redis_client, tmp_path
) -> None:
    api = make_api(token="s3cret")
    auth = {"Authorization": "Bearer s3cret"}
    job_id = api.post("/jobs", json=job_body(tiny_llama, dataset), headers=auth).json()["job_id"]

    m = scrape(api)  # open without the token, like /health
    assert value(m, "layertap_job_samples", job_id=job_id, status="remaining") == 45
    assert value(m, "layertap_job_samples", job_id=job_id, status="done") == 0
    assert value(m, "layertap_job_progress_ratio", job_id=job_id) == 0
    assert value(m, "layertap_job_state", job_id=job_id, state="running") == 1
    assert value(m, "layertap_job_state", job_id=job_id, state="done") == 0
    assert value(m, "layertap_job_shards", job_id=job_id, state="queued") == 5
    assert value(m, "layertap_broker_queue_messages") == redis_client.llen(SHARD_QUEUE) == 5
    assert value(m, "layertap_job_eta_seconds", job_id=job_id) is None  # nothing moves yet
    assert value(m, "layertap_job_submissions_total", status="accepted") >= 1
    assert value(m, "layertap_redis_up") == 1
    assert abs(value(m, "layertap_output_free_bytes") - free_bytes(tmp_path / "outputs")) < 64 << 20
    assert value(m, "layertap_output_min_free_bytes") == 1 << 30

    # A worker claims shard 0, commits three samples and says it is paused for lack of disk.
    token = redis_client.hget(KEYS.shard(job_id, 0), "token")
    attempt = ShardAttempt(redis_client, KEYS, job_id, 0, token, "w1")
    assert attempt.claim(30_000).status == "ok" and attempt.start(0, 0)
    for tokens in (100, 120, 80):
        assert attempt.sample_done(tokens) == "running"
    reason = "low disk: 1.0 GiB free on /out, below the floor of 2.0 GiB"
    record = {"job": job_id, "shard": 0, "samples_per_s": 2.0, "tokens_per_s": 200.0, "state": "paused",
              "reason": reason, "free_bytes": 1 << 30, "host": "node1", "engine": "hf"}  # fmt: skip
    publish_worker(redis_client, KEYS, "w1", record, 30_000)

    m = scrape(api)
    assert value(m, "layertap_job_samples", job_id=job_id, status="done") == 3
    assert value(m, "layertap_job_samples", job_id=job_id, status="remaining") == 42
    assert value(m, "layertap_job_tokens", job_id=job_id, status="done") == 300
    assert value(m, "layertap_job_tokens", job_id=job_id, status="remaining") == 100 * 45 - 300
    assert value(m, "layertap_job_progress_ratio", job_id=job_id) == 3 / 45
    assert value(m, "layertap_job_samples_per_second", job_id=job_id) == 2.0
    assert value(m, "layertap_job_tokens_per_second", job_id=job_id) == 200.0
    assert value(m, "layertap_job_eta_seconds", job_id=job_id) == 42 / 2.0
    assert value(m, "layertap_job_shards", job_id=job_id, state="running") == 1
    assert value(m, "layertap_workers", state="paused") == 1
    assert value(m, "layertap_workers", state="working") == 0

    assert api.get("/workers").status_code == 401
    workers = api.get("/workers", headers=auth).json()
    assert workers["count"] == 1
    w = workers["workers"][0]
    assert (w["name"], w["state"], w["reason"], w["job"], w["shard"]) == ("w1", "paused", reason, job_id, 0)
    assert (w["free_bytes"], w["tokens_per_s"], w["host"]) == (1 << 30, 200.0, "node1")

    redis_client.delete(KEYS.worker("w1"))  # its heartbeat stopped
    assert api.get("/workers", headers=auth).json()["count"] == 0
    assert value(scrape(api), "layertap_workers", state="paused") == 0


def test_a_job_whose_expected_output_does_not_fit_is_refused_before_anything_is_created(
    make_api, tiny_llama, dataset, redis_client, tmp_path, monkeypatch
) -> None:
    root = tmp_path / "outputs"
    num_layers, hidden = model_dims(tiny_llama)
    per_token = bytes_per_token(ExtractionSpec(model=tiny_llama, data=dataset, layers=[1, 3, 5]).resolve(num_layers),
                                hidden, "bfloat16")  # fmt: skip
    free = free_bytes(root)
    small = 1000  # tokens: well under a MiB
    # Fits on the volume, but would leave less than the floor free.
    monkeypatch.setenv("LAYERTAP_MIN_FREE_BYTES", str(free - small * per_token // 2))
    api = make_api()

    too_big = api.post("/jobs", json=job_body(tiny_llama, dataset, expected_tokens=free // per_token + 1))
    assert too_big.status_code == 507, too_big.text
    assert "free" in too_big.json()["detail"] and "LAYERTAP_MIN_FREE_BYTES" in too_big.json()["detail"]
    under_floor = api.post("/jobs", json=job_body(tiny_llama, dataset, expected_tokens=small))
    assert under_floor.status_code == 507, under_floor.text
    assert nothing_enqueued(redis_client, tmp_path)
    assert value(scrape(api), "layertap_job_submissions_total", status="no_space") == 2

    monkeypatch.setenv("LAYERTAP_MIN_FREE_BYTES", "1MiB")
    api = make_api()
    fits = api.post("/jobs", json=job_body(tiny_llama, dataset, expected_tokens=small))
    assert fits.status_code == 201, fits.text
    assert not api.post("/jobs", json=job_body(tiny_llama, dataset, expected_tokens=0)).is_success  # must be > 0
    missing_model = api.post("/jobs", json=job_body(Path("/nonexistent/model"), dataset, expected_tokens=small))
    assert missing_model.status_code == 422 and "config.json" in missing_model.text


def test_the_status_page_and_its_assets_are_served_without_a_token(make_api) -> None:
    api = make_api(token="s3cret")
    root = api.get("/", follow_redirects=False)
    assert root.status_code in (302, 307) and root.headers["location"] == "/status"
    page = api.get("/status")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/status/status.js">' in page.text and 'href="/status/status.css"' in page.text
    script = api.get("/status/status.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert "/jobs?limit=" in script.text and "/workers" in script.text
    assert api.get("/status/status.css").headers["content-type"].startswith("text/css")
    assert api.get("/status/../config.py").status_code == 404
    assert api.get("/status/secrets.txt").status_code == 404


def test_a_regenerating_jobs_generation_shows_in_its_view_and_metrics_and_a_plain_jobs_does_not(
    api, tiny_llama, dataset, redis_client
) -> None:
    plain = api.post("/jobs", json=job_body(tiny_llama, dataset)).json()["job_id"]
    job_id = api.post("/jobs", json=job_body(tiny_llama, dataset, out="regen")).json()["job_id"]
    token = redis_client.hget(KEYS.shard(job_id, 0), "token")
    attempt = ShardAttempt(redis_client, KEYS, job_id, 0, token, "w1")
    assert attempt.claim(30_000).status == "ok" and attempt.start(0, 0)
    spec = json.loads(redis_client.hget(KEYS.job(job_id), "spec"))
    redis_client.hset(KEYS.job(job_id), "spec", json.dumps(spec | {"regenerate": "all"}))  # as `regenerate` stores it
    for row, (new, cut) in enumerate([(120, 0), (256, 1), (80, 0)]):
        assert attempt.row_generated(row, new, cut) == "running"
    assert attempt.sample_done(400) == "running"
    record = {"job": job_id, "shard": 0, "samples_per_s": 0.5, "tokens_per_s": 200.0, "generated_tokens_per_s": 60.0}
    publish_worker(redis_client, KEYS, "w1", record, 30_000)

    job = api.get(f"/jobs/{job_id}").json()
    # 44 rows left, 2 regenerated rows wait for their capture: 42 to regenerate at 152 new tokens a row.
    assert job["generation"] == {"rows": 3, "tokens": 456, "cut_turns": 1, "tokens_per_s": 60.0,
                                 "eta_s": pytest.approx(42 * 152 / 60.0)}  # fmt: skip
    assert job["eta_s"] == pytest.approx(42 * 152 / 60.0)  # the slower stream: capture would take 44 / 0.5
    assert job["workers"][0]["generated_tokens_per_s"] == 60.0
    assert api.get(f"/jobs/{plain}").json()["generation"] is None

    m = scrape(api)
    assert value(m, "layertap_job_generated_tokens", job_id=job_id) == 456
    assert value(m, "layertap_job_generated_tokens_per_second", job_id=job_id) == 60.0
    assert value(m, "layertap_job_cut_turns", job_id=job_id) == 1
    assert value(m, "layertap_job_eta_seconds", job_id=job_id) == pytest.approx(42 * 152 / 60.0)
    assert value(m, "layertap_job_generated_tokens", job_id=plain) is None
    assert value(m, "layertap_job_cut_turns", job_id=plain) is None
