"""Whole jobs on real services: uvicorn coordinator, two ``celery -A worker worker`` processes, Redis.

Each run must end with the same result: every sample present exactly once, byte-identical to an
uninterrupted single-process run, and ``layertap verify`` clean.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from harness.processes import wait_for, wait_moving
from layertap.store.index import INDEX_DIR
from layertap.store.store import OutputStore
from layertap.store.token_freq import TOKEN_FREQ_DIR
from tests.worker.conftest import NUM_SAMPLES, SHARD_SIZE, STALL_S, check_output, layertap


def test_a_job_submitted_with_the_cli_completes_exactly_once_over_two_workers(
    start_cluster, tiny_llama, corpus, reference
) -> None:
    cluster = start_cluster(token="t0ken")
    api = {"LAYERTAP_API_URL": cluster.coordinator.url, "LAYERTAP_API_TOKEN": "t0ken"}
    submitted = layertap("submit", "--model", str(tiny_llama), "--data", str(corpus), "--layers", "1,3,5",
                         "--shard-size", str(SHARD_SIZE), "--batch-size", "1", "--out", "cli-job", env=api)  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()

    # While it runs, the live workers' rates give a rate and an ETA.
    seen = []

    def done_watching_rates() -> dict | None:
        job = cluster.job(job_id)
        if job["state"] == "running" and job["samples_per_s"] > 0:
            seen.append(job)
        return job if job["state"] == "done" else None

    job = wait_moving(done_watching_rates, moved=lambda: cluster.samples_done(job_id), stall=STALL_S,
                      what="the job to be done", every=0.1)  # fmt: skip
    assert seen, "no rate was reported while the job ran"
    assert all(j["eta_s"] is not None and j["tokens_per_s"] > 0 for j in seen)
    assert any(w["alive"] and w["shard"] is not None for j in seen for w in j["workers"])
    assert (job["samples_done"], job["samples_failed"], job["samples_total"]) == (NUM_SAMPLES, 0, NUM_SAMPLES)
    assert job["shards"] == {"done": NUM_SAMPLES // SHARD_SIZE} and job["eta_s"] == 0
    workers = {w["name"]: w for w in job["workers"]}
    assert set(workers) == {"w1", "w2"} and all(w["samples"] > 0 for w in workers.values())
    assert sum(w["samples"] for w in workers.values()) == NUM_SAMPLES
    check_output(Path(job["out"]), reference)
    records = OutputStore.open_existing(Path(job["out"])).records().values()
    assert job["tokens_done"] == sum(r.num_tokens for r in records)
    # token_freq.pt (checked in check_output) was merged from both workers' counts.
    counted_by = {log.name.split("-s")[0] for log in (Path(job["out"]) / TOKEN_FREQ_DIR).glob("*.jsonl")}
    assert counted_by == {"w1", "w2"}

    shown = layertap("status", job_id, "--json", env=api)
    assert shown.returncode == 0, shown.stderr
    assert '"state": "done"' in shown.stdout
    denied = layertap("status", job_id, env={**api, "LAYERTAP_API_TOKEN": "wrong"})
    assert denied.returncode == 2 and "401" in denied.stderr
    verified = layertap("verify", job["out"])
    assert verified.returncode == 0 and "clean" in verified.stderr, verified.stderr


def test_a_worker_killed_with_sigkill_mid_shard_loses_nothing_and_duplicates_nothing(
    start_cluster, tiny_llama, corpus, reference
) -> None:
    cluster = start_cluster()
    job_id = cluster.submit(tiny_llama, corpus)
    victim = cluster.freeze_mid_shard(job_id)
    cluster.workers[victim["worker"]].kill(signal.SIGKILL)
    cluster.add_worker("w3")  # a replacement node comes up

    job = cluster.wait_state(job_id, "done")
    shard = cluster.shards(job_id)[victim["n"]]
    assert int(shard["attempts"]) >= 2 and shard["worker"] != victim["worker"]  # requeued after the lease expired
    killed_log = Path(job["out"]) / INDEX_DIR / f"{victim['worker']}-s{victim['n']}-t{victim['token']}.jsonl"
    assert 2 <= len(killed_log.read_text().splitlines()) < SHARD_SIZE  # it died in the middle of its shard
    assert job["samples_done"] == NUM_SAMPLES
    check_output(Path(job["out"]), reference)


def test_the_coordinator_restarted_mid_job_picks_up_where_it_was(start_cluster, tiny_llama, corpus, reference) -> None:
    cluster = start_cluster()
    job_id = cluster.submit(tiny_llama, corpus)
    wait_for(lambda: cluster.samples_done(job_id) >= 30, timeout=120, what="30 samples done")
    cluster.coordinator.proc.kill(signal.SIGKILL)
    assert cluster.samples_done(job_id) < NUM_SAMPLES
    # Without a coordinator the workers go on; one of them dies, which only a watchdog can notice.
    before = cluster.samples_done(job_id)
    wait_for(lambda: cluster.samples_done(job_id) > before + 10, timeout=120, what="progress without a coordinator")
    victim = cluster.freeze_mid_shard(job_id)
    cluster.workers[victim["worker"]].kill(signal.SIGKILL)

    cluster.restart_coordinator()
    job = cluster.wait_state(job_id, "done")
    assert int(cluster.shards(job_id)[victim["n"]]["attempts"]) >= 2
    assert [w["name"] for w in job["workers"] if w["samples"]] == sorted(cluster.workers)
    check_output(Path(job["out"]), reference)


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["restart", "crash"])
def test_redis_restarted_mid_job_with_persistence_on(
    start_cluster, redis_factory, tiny_llama, corpus, reference, how
) -> None:
    redis = redis_factory("--appendonly", "yes")  # as docker-compose runs it (AOF, fsync every second)
    cluster = start_cluster(redis=redis)
    job_id = cluster.submit(tiny_llama, corpus)
    shard = cluster.freeze_mid_shard(job_id, all_workers=True)
    redis.restart(how)  # the workers wake up mid-shard with every connection gone
    cluster.thaw()

    job = cluster.wait_state(job_id, "done")
    assert job["samples_done"] == NUM_SAMPLES and job["shards"] == {"done": NUM_SAMPLES // SHARD_SIZE}
    assert int(cluster.shards(job_id)[shard["n"]]["done"]) == SHARD_SIZE
    check_output(Path(job["out"]), reference)


def test_cancel_stops_dispatch_and_releases_running_shards_then_resume_completes(
    start_cluster, tiny_llama, corpus, reference
) -> None:
    cluster = start_cluster()
    job_id = cluster.submit(tiny_llama, corpus)
    frozen = cluster.freeze_mid_shard(job_id, all_workers=True)
    running = {n: s for n, s in enumerate(cluster.shards(job_id)) if s["state"] == "running"}
    with cluster.api() as api:
        assert api.post(f"/jobs/{job_id}/cancel").json()["state"] == "cancelled"
    cluster.thaw()

    def settled() -> list[dict] | None:
        shards = cluster.shards(job_id)
        return shards if not any(s["state"] == "running" for s in shards) else None

    shards = wait_for(settled, timeout=30, what="running shards to finish or be released")
    # Nothing moves any more: watched for six reaper passes, while idle workers take any queued message
    # within milliseconds, no shard is claimed and no sample counted.
    time.sleep(3)
    assert cluster.shards(job_id) == shards
    # The shard caught mid-way was released at its next sample, keeping what it had committed; queued
    # shards were never started.
    released = shards[frozen["n"]]
    assert released["state"] == "pending" and int(frozen["done"]) <= int(released["done"]) < SHARD_SIZE
    assert all(s["state"] in ("done", "pending") for n, s in enumerate(shards) if n in running)
    assert {s["state"] for n, s in enumerate(shards) if n not in running} <= {"done", "queued"}
    assert "queued" in {s["state"] for s in shards}
    out = Path(cluster.job(job_id)["out"])
    assert sum(int(s["done"]) for s in shards) == len(OutputStore.open_existing(out).records())

    with cluster.api() as api:
        assert api.post(f"/jobs/{job_id}/resume").json()["state"] == "running"
    cluster.wait_state(job_id, "done")
    check_output(out, reference)
