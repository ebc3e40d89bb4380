"""``WorkerContext`` in this process (no Celery): a shard attempt end to end, and a finalize that fails
and is sent again by the watchdog. Real Redis, real store, the HF engine."""

import json
import os
from pathlib import Path

import pytest

from layertap.pipeline import Run, plan_run, target_for
from layertap.state.jobs import create_job, reap
from layertap.state.keys import FINALIZE_TASK, Keys
from layertap.state.model import JobSpec
from layertap.state.plan import plan_job
from layertap.state.shards import ShardAttempt
from layertap.state.views import job_view
from layertap.store.store import OutputStore
from layertap.verify import verify_store
from tests.core.datasets import conversation_rows, write_jsonl
from tests.folder_reads import counting_folder_reads
from tests.hf_engines import hf_engine
from worker.config import WorkerSettings
from worker.runner import WorkerContext


def no_messages(task: str, args: list) -> None:
    """These jobs ask for no audit: a worker sends nothing."""
    raise AssertionError(f"unexpected message {task} {args}")


@pytest.fixture
def context(redis_server, redis_client):
    ctx = WorkerContext(WorkerSettings(redis_url=redis_server.url, worker_name="local", lease_ttl_s=30), no_messages)
    yield ctx
    ctx.close()


def test_a_failed_finalize_is_reported_and_done_again_by_the_watchdog(context, tiny_llama, tmp_path, redis_client):
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(12, seed=8))
    spec = JobSpec(model=tiny_llama, data=data, layers=(1, 3), shard_size=10, format="speculators")
    planned = plan_job(spec, output_root=tmp_path / "outputs", job_id="jf")
    keys = Keys()
    create_job(redis_client, keys, "jf", planned.spec, planned.shards)
    sent: list[tuple[str, list]] = []
    reap(redis_client, keys, lambda task, args: sent.append((task, args)), queue_len=0, queued_grace_ms=0, lease_ms=1)
    assert [args[1] for _, args in sent] == [0, 1]

    assert context.run_shard(*sent[0][1]) == "done"
    # A committed file goes missing before the last shard completes: speculators' finalize cannot link it.
    first = planned.spec.out / "samples" / "hs_0.safetensors"
    saved = first.read_bytes()
    first.unlink()
    assert context.run_shard(*sent[1][1]) == "finalize-failed"
    view = job_view(redis_client, keys, "jf")
    assert view.state == "finalizing" and view.shards == {"done": 2} and "finalize failed" in view.error

    first.write_bytes(saved)
    redis_client.delete(keys.finalize_lease("jf"))  # the failed finalizer's lease runs out
    sent.clear()
    reap(
        redis_client,
        keys,
        lambda task, args: sent.append((task, args)),
        queue_len=0,
        queued_grace_ms=0,
        lease_ms=60_000,
    )
    [(task, args)] = sent
    assert task == FINALIZE_TASK and context.finalize(*args) == "finalized"
    view = job_view(redis_client, keys, "jf")
    assert (view.state, view.error, view.samples_done) == ("done", None, 12)
    report = verify_store(planned.spec.out)
    assert report.ok and report.complete, report.problems
    assert Path(planned.spec.out / "hidden_states").is_dir()  # speculators' finalize ran


def test_a_job_with_remote_code_runs_only_on_a_worker_allowed_to(redis_server, redis_client, tiny_kimi25, tmp_path):
    from layertap.errors import ServerError

    data = Path(__file__).resolve().parents[1] / "assets" / "datasets" / "kimi_chats.jsonl"
    spec = JobSpec(model=tiny_kimi25, data=data, layers=(1, 2, 3), shard_size=10, trust_remote_code=True)
    planned = plan_job(spec, output_root=tmp_path / "outputs", job_id="jr")
    keys = Keys()
    create_job(redis_client, keys, "jr", planned.spec, planned.shards)
    sent: list[tuple[str, list]] = []
    reap(redis_client, keys, lambda task, args: sent.append((task, args)), queue_len=0, queued_grace_ms=0, lease_ms=1)
    [(_, args)] = sent

    settings = {"redis_url": redis_server.url, "lease_ttl_s": 30}
    closed = WorkerContext(WorkerSettings(worker_name="closed", **settings), no_messages)
    try:
        with pytest.raises(ServerError, match="LAYERTAP_ALLOW_REMOTE_CODE"):
            closed.run_shard(*args)
    finally:
        closed.close()
    assert verify_store(planned.spec.out).samples == 0
    redis_client.delete(keys.lease("jr", 0))  # the refusing worker's lease runs out
    opened = WorkerContext(WorkerSettings(worker_name="open", allow_remote_code=True, **settings), no_messages)
    try:
        assert opened.run_shard(*args) in ("done", "finalized")
    finally:
        opened.close()
    assert verify_store(planned.spec.out).samples == 6


def test_a_worker_starts_its_engine_before_it_claims_a_shard(context, tiny_llama, tmp_path, redis_client):
    """A server that takes minutes to start (a restarted worker's) must not hold a shard meanwhile: the engine is
    built while the shard is still queued, so the watchdog can hand the shard to a ready worker."""
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(6, seed=3))
    spec = JobSpec(model=tiny_llama, data=data, layers=(1, 3, 5), shard_size=10)
    planned = plan_job(spec, output_root=tmp_path / "outputs", job_id="je")
    keys = Keys()
    create_job(redis_client, keys, "je", planned.spec, planned.shards)
    sent: list[tuple[str, list]] = []

    def send(task: str, args: list) -> None:
        sent.append((task, args))

    reap(redis_client, keys, send, queue_len=0, queued_grace_ms=60_000, lease_ms=1)
    [(_, first)] = sent
    seen: dict[str, object] = {}
    build = context.engines.get

    def starting(job_spec, capture, folder):  # the real engine, watched while it starts
        seen["state"] = redis_client.hget(keys.shard("je", 0), "state")
        seen["lease"] = redis_client.exists(keys.lease("je", 0))
        reap(redis_client, keys, send, queue_len=0, queued_grace_ms=0, lease_ms=1)  # its grace is over
        context.engines.get = build
        return build(job_spec, capture, folder)

    context.engines.get = starting
    assert context.run_shard(*first) != "done"  # the watchdog gave the shard on while this worker started
    assert seen == {"state": "queued", "lease": 0}
    [(_, second)] = sent[1:]
    assert second[2] != first[2] and context.run_shard(*second) in ("done", "finalized")
    assert job_view(redis_client, keys, "je").samples_done == 6


def test_a_shard_attempt_retires_a_sample_its_row_no_longer_gives_and_counts_it_once(
    context, tiny_llama, tmp_path, redis_client, monkeypatch
):
    rows = conversation_rows(8, seed=6, max_words=15)
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    spec = JobSpec(model=tiny_llama, data=data, layers=(1, 3, 5), shard_size=10)
    planned = plan_job(spec, output_root=tmp_path / "outputs", job_id="jc")
    store = OutputStore.open_existing(planned.spec.out)
    engine = hf_engine(tiny_llama, planned.spec.resolve(6))
    plan = plan_run(planned.spec.extraction(), stored=store.manifest).on(engine)
    Run(plan, engine, store, target_for(store, None)).rows()  # an earlier attempt's
    store.close()
    rows[4]["messages"][-1]["content"] += " edited"
    write_jsonl(data, rows)
    keys = Keys()
    create_job(redis_client, keys, "jc", planned.spec, planned.shards)
    sent: list[tuple[str, list]] = []
    reap(redis_client, keys, lambda task, args: sent.append((task, args)), queue_len=0, queued_grace_ms=0, lease_ms=1)
    [(_, args)] = sent
    counts: list[str] = []  # the shard's done count in Redis after each commit
    sample_done = ShardAttempt.sample_done

    def counted(attempt: ShardAttempt, tokens: int) -> str:
        state = sample_done(attempt, tokens)
        counts.append(redis_client.hget(keys.shard("jc", 0), "done"))
        return state

    monkeypatch.setattr(ShardAttempt, "sample_done", counted)
    assert context.run_shard(*args) == "finalized"
    assert counts == [str(len(rows))]  # the redone sample takes the retired one's place: never 9 of 8
    report = json.loads(max((planned.spec.out / "reports").glob("run-*.json"), key=os.path.getmtime).read_text())
    assert (report["changed"], report["computed"], report["already_done"]) == (["conv-4"], ["conv-4"], len(rows) - 1)
    assert job_view(redis_client, keys, "jc").samples_done == len(rows)


def test_a_shard_attempt_reads_the_model_folder_once_for_its_engine_and_its_rows(
    context, tiny_llama, tmp_path, redis_client, monkeypatch
):
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(12, seed=2, max_words=12))
    spec = JobSpec(model=tiny_llama, data=data, layers=(1, 3, 5), shard_size=10)
    planned = plan_job(spec, output_root=tmp_path / "outputs", job_id="jr")
    keys = Keys()
    create_job(redis_client, keys, "jr", planned.spec, planned.shards)
    sent: list[tuple[str, list]] = []
    reap(redis_client, keys, lambda task, args: sent.append((task, args)), queue_len=0, queued_grace_ms=0, lease_ms=1)

    with counting_folder_reads(monkeypatch) as reads:
        context.prepare_engine("jr")  # the engine built before the claim
    assert reads == {"layertap.pipeline.plan": 1}, reads
    with counting_folder_reads(monkeypatch) as reads:
        assert context.run_shard(*sent[0][1]) == "done"
    assert reads == {"layertap.pipeline.plan": 1}, reads  # one read for the engine (kept) and the shard's rows
    with counting_folder_reads(monkeypatch) as reads:
        assert context.run_shard(*sent[1][1]) == "finalized"
    assert reads == {"layertap.pipeline.plan": 1, "layertap.store.guide": 1}, reads  # and its finalize's guide
    assert verify_store(planned.spec.out).samples == 12
