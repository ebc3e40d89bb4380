"""A job that audits itself at its end (``audit_samples``): the audit is sent by the worker that finalized the job,
runs once however often its message is delivered, on the worker's device (``auto`` unless set: the one rule
``layertap audit`` uses), and its verdict, device and progress show beside the job's state in the API, ``layertap
status``, the status page and ``/metrics``. A FAIL leaves the job ``done``. Real Redis, store, HF engine and
reference; the last tests run a real coordinator (and Celery worker, and headless Chromium)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from harness.services import Services
from layertap.device import pick_device
from layertap.state.jobs import create_job, reap
from layertap.state.keys import AUDIT_TASK, RUN_SHARD_TASK, Keys
from layertap.state.model import AuditView, JobSpec
from layertap.state.plan import plan_job
from layertap.state.shards import AuditAttempt
from layertap.state.views import job_view
from layertap.store.store import OutputStore
from tests.core.datasets import conversation_rows, write_jsonl
from tests.monitoring.test_live import _Page, chromium
from tests.worker.conftest import layertap
from worker.audit import AuditProgress, run_job_audit
from worker.config import WorkerSettings
from worker.runner import WorkerContext

HERE = str(pick_device("auto"))  # where a worker with no LAYERTAP_DEVICE audits on this machine


@pytest.fixture
def sent() -> list[tuple[str, list]]:
    return []


@pytest.fixture
def context(redis_server, redis_client, sent):
    ctx = WorkerContext(
        WorkerSettings(redis_url=redis_server.url, worker_name="local", lease_ttl_s=30),
        lambda task, args: sent.append((task, args)),
    )
    yield ctx
    ctx.close()


def start_job(redis, sent: list, job_id: str, spec: JobSpec, root: Path) -> Path:
    """Create the job and dispatch its shards (their messages land in ``sent``); returns its store."""
    planned = plan_job(spec, output_root=root, job_id=job_id)
    create_job(redis, Keys(), job_id, planned.spec, planned.shards)
    reap(redis, Keys(), lambda task, args: sent.append((task, args)), queue_len=0, queued_grace_ms=0, lease_ms=1)
    return planned.spec.out


def run_the_shard(context: WorkerContext, sent: list, job_id: str) -> None:
    """Run the job's one shard in this process; completing it finalizes the job."""
    [args] = [args for task, args in sent if task == RUN_SHARD_TASK and args[0] == job_id]
    assert context.run_shard(*args) == "finalized"


def test_the_audit_is_sent_at_the_end_and_a_redelivered_message_never_runs_it_twice(
    context, redis_client, sent, tiny_llama, tmp_path
) -> None:
    keys = Keys()
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(12, seed=8))
    spec = JobSpec(model=tiny_llama, data=data, layers=(1, 3, 5), shard_size=12, audit_samples=4)
    out = start_job(redis_client, sent, "ja", spec, tmp_path / "outputs")
    assert job_view(redis_client, keys, "ja").audit == AuditView(state="pending", samples=4)
    assert run_job_audit(context, "ja") == "inactive"  # a message before the job ended: nothing runs

    run_the_shard(context, sent, "ja")
    assert sent[-1] == (AUDIT_TASK, ["ja"])  # sent by the finalize, not run in it
    assert job_view(redis_client, keys, "ja").audit.state == "pending"

    # Another worker holds the audit (its lease is alive): this delivery leaves it alone.
    other = AuditAttempt(redis_client, keys, "ja", "other")
    assert other.claim(60_000)[0] == "ok"
    assert run_job_audit(context, "ja") == "busy"
    assert job_view(redis_client, keys, "ja").audit.state == "running"
    # That worker died: once its lease expires, a redelivered message takes the audit over.
    redis_client.delete(keys.audit_lease("ja"))
    assert run_job_audit(context, "ja") == "pass"
    assert not other.finish(AuditView(state="fail", samples=4))  # the worker that lost it cannot overwrite it

    view = job_view(redis_client, keys, "ja")
    audit = view.audit
    assert view.state == "done" and audit.state == "pass" and audit.samples == 4 and audit.seconds > 0
    assert audit.summary.startswith("audit PASS: 4 of 12 samples") and audit.tokens > 0
    reports = sorted((out / "reports").glob("audit-*"))
    assert [p.suffix for p in reports] == [".json", ".md"] and audit.report == str(reports[1])
    # Delivered once more: the verdict is recorded, nothing runs again.
    assert run_job_audit(context, "ja") == "done"
    assert sorted((out / "reports").glob("audit-*")) == reports and job_view(redis_client, keys, "ja").audit == audit
    assert redis_client.hget(keys.audit("ja"), "attempts") == "2"  # the dead worker's claim and this one


def test_a_failed_audit_leaves_the_job_done_and_says_fail(context, redis_client, sent, tiny_llama, tmp_path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(6, seed=9))
    spec = JobSpec(model=tiny_llama, data=data, layers=(1, 3, 5), shard_size=6, audit_samples=2)
    out = start_job(redis_client, sent, "jf", spec, tmp_path / "outputs")
    run_the_shard(context, sent, "jf")
    for rec in OutputStore.open_existing(out).records().values():  # every state one token late
        tensors = torch.load(out / rec.file, weights_only=True)
        torch.save(
            {k: v.roll(1, dims=1) if k.endswith("hidden_state") else v for k, v in tensors.items()}, out / rec.file
        )
    assert run_job_audit(context, "jf") == "fail"
    view = job_view(redis_client, Keys(), "jf")
    assert view.state == "done" and view.audit.state == "fail" and view.audit.summary.startswith("audit FAIL: 2 of 6")
    assert "shifted one token" in Path(view.audit.report).read_text()


def test_an_inconclusive_verdict_is_recorded_once(context, redis_client, sent, tiny_llama, tmp_path) -> None:
    """INCONCLUSIVE (`layertap audit` exit 3: the comparison cannot tell there) is a verdict like PASS and FAIL: a
    redelivered message finds it recorded and does not audit again."""
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(6, seed=9))
    spec = JobSpec(model=tiny_llama, data=data, layers=(1, 3, 5), shard_size=6, audit_samples=2)
    start_job(redis_client, sent, "ji", spec, tmp_path / "outputs")
    run_the_shard(context, sent, "ji")
    attempt = AuditAttempt(redis_client, Keys(), "ji", "other")
    assert attempt.claim(30_000)[0] == "ok"
    verdict = AuditView(state="inconclusive", samples=2, tokens=9, summary="audit INCONCLUSIVE: 2 of 6 samples")
    assert attempt.finish(verdict)
    assert run_job_audit(context, "ji") == "done"
    assert job_view(redis_client, Keys(), "ji").audit == verdict


def test_a_job_with_audit_samples_ends_with_its_verdict_in_the_api_status_and_metrics(
    start_cluster, tiny_llama, tmp_path
) -> None:
    cluster = start_cluster(workers=1)
    api = {"LAYERTAP_API_URL": cluster.coordinator.url}
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(16, seed=5))
    submitted = layertap("submit", "--model", str(tiny_llama), "--data", str(data), "--layers", "1,3,5",
                         "--shard-size", "8", "--audit-samples", "4", "--wait", env=api)  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr[-3000:]  # --wait waited for the audit's PASS
    job_id = submitted.stdout.splitlines()[0].strip()
    job = cluster.job(job_id)
    assert job["state"] == "done" and job["audit"]["state"] == "pass" and job["audit"]["samples"] == 4
    assert job["audit"]["summary"].startswith("audit PASS: 4 of 16 samples") and Path(job["audit"]["report"]).exists()
    # The worker was given no device: it audited where `auto` points (the report says so), every layer of the tiny
    # Llama's 6 (a final state is stored: the reference runs the whole stack).
    assert (job["audit"]["device"], job["audit"]["layers_done"], job["audit"]["layers_total"]) == (HERE, 6, 6)
    assert json.loads(Path(job["audit"]["report"]).with_suffix(".json").read_text())["device"] == HERE

    shown = layertap("status", job_id, env=api | {"COLUMNS": "400"})
    assert shown.returncode == 0, shown.stderr
    [line] = [line for line in shown.stdout.splitlines() if "│ audit " in line]
    assert f"PASS on {HERE}, 6/6 layers: audit PASS: 4 of 16 samples" in line and job["audit"]["report"] in line

    metrics = httpx.get(f"{cluster.coordinator.url}/metrics", timeout=10).text
    verdicts = {
        s.labels["verdict"]: s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "layertap_job_audit" and s.labels["job_id"] == job_id
    }
    assert verdicts == {"pending": 0, "running": 0, "pass": 1, "fail": 0, "inconclusive": 0, "error": 0}


def test_a_worker_with_no_device_setting_audits_where_auto_points(redis_server) -> None:
    assert WorkerSettings(redis_url=redis_server.url).device == "auto"
    with pytest.raises(ValueError, match="device 'gpu': expected cpu, cuda, cuda:N, or auto"):
        WorkerSettings(redis_url=redis_server.url, device="gpu")  # refused at start-up, not at the first audit


def test_progress_is_one_round_trip_per_write_throttled_and_only_by_the_audits_holder(
    context, redis_client, sent, tiny_llama, tmp_path
) -> None:
    keys = Keys()
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(4, seed=3))
    start_job(redis_client, sent, "jt", JobSpec(model=tiny_llama, data=data, layers=(1, 3, 5), audit_samples=2),
              tmp_path / "outputs")  # fmt: skip
    run_the_shard(context, sent, "jt")
    first = AuditAttempt(redis_client, keys, "jt", "w1")
    assert first.claim(60_000)[0] == "ok"

    def seen() -> tuple:
        audit = job_view(redis_client, keys, "jt").audit
        return audit.device, audit.layers_done, audit.layers_total

    def writes() -> int:  # scripts run (the worker's background threads publish its record without one)
        return redis_client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)

    slow = AuditProgress(first, "cpu", every_s=3600)
    slow(0, 6)  # the start is always written
    assert seen() == ("cpu", 0, 6)
    before = writes()
    for done in range(1, 6):
        slow(done, 6)  # within the interval: nothing written
    assert writes() == before and seen() == ("cpu", 0, 6)
    slow(6, 6)  # the end is always written
    assert seen() == ("cpu", 6, 6)

    before = writes()
    every = AuditProgress(first, "cpu", every_s=0)
    for done in range(1, 4):
        every(done, 6)
    assert writes() == before + 3 and seen() == ("cpu", 3, 6)  # one script, one round trip, per write

    # The holder died; a new claim starts without its progress, and the old claim can no longer write any.
    redis_client.delete(keys.audit_lease("jt"))
    second = AuditAttempt(redis_client, keys, "jt", "w2")
    assert second.claim(60_000)[0] == "ok" and seen() == (None, None, None)
    assert not first.progress("cpu", 5, 6) and seen() == (None, None, None)
    assert second.progress("cpu", 1, 6) and seen() == ("cpu", 1, 6)


def test_a_running_audit_shows_its_device_and_progress_in_the_api_status_and_page(
    context, redis_server, redis_client, sent, services: Services, tiny_llama, tmp_path
) -> None:
    keys = Keys()
    root = tmp_path / "outputs"
    coordinator = services.coordinator(redis_server.url, root)
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(12, seed=8))
    spec = JobSpec(model=tiny_llama, data=data, layers=(1, 3, 5), shard_size=12, audit_samples=4)
    start_job(redis_client, sent, "jp", spec, root)
    run_the_shard(context, sent, "jp")

    # A worker runs the audit and has written how far it is (what `AuditProgress` writes while the reference runs).
    other = AuditAttempt(redis_client, keys, "jp", "other")
    assert other.claim(60_000)[0] == "ok" and other.progress("cpu", 2, 6)
    with coordinator.client() as api:
        audit = api.get("/jobs/jp").json()["audit"]
    assert (audit["state"], audit["device"], audit["layers_done"], audit["layers_total"]) == ("running", "cpu", 2, 6)
    shown = layertap("status", "jp", env={"LAYERTAP_API_URL": coordinator.url, "COLUMNS": "400"})
    assert shown.returncode == 0, shown.stderr
    assert "running on cpu, 2/6 layers (4 samples)" in shown.stdout, shown.stdout
    page = _Page()
    page.feed(chromium(f"{coordinator.url}/status", tmp_path / "profile", "--dump-dom").stdout)
    assert "running on cpu, 2 / 6 layers: 4 samples" in " ".join(page.jobs["jp"]["text"].split()), page.jobs

    # That worker died; this one (no device setting) takes the audit over and ends it at every layer, on `auto`'s.
    redis_client.delete(keys.audit_lease("jp"))
    assert run_job_audit(context, "jp") == "pass"
    with coordinator.client() as api:
        audit = api.get("/jobs/jp").json()["audit"]
    assert (audit["state"], audit["device"], audit["layers_done"], audit["layers_total"]) == ("pass", HERE, 6, 6)
    assert json.loads(Path(audit["report"]).with_suffix(".json").read_text())["device"] == HERE
