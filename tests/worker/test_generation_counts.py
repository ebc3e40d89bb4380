"""A regenerated row, as the pipeline reports it to a worker (`RedisEvents.generated`): counted once in Redis, in the
worker's metrics (what its ``/metrics`` serves) and in the generation rate its heartbeat publishes."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from harness.services import Services
from layertap.state.jobs import create_job, dispatch_pending
from layertap.state.keys import Keys
from layertap.state.shards import ShardAttempt, publish_worker
from layertap.state.views import job_view
from tests.core.state.support import SPEC, regenerating
from tests.monitoring.test_live import _Page, chromium
from tests.worker.conftest import layertap
from worker.config import WorkerSettings
from worker.runner import RedisEvents, WorkerContext


@pytest.fixture
def context(redis_server, redis_client):
    ctx = WorkerContext(WorkerSettings(redis_url=redis_server.url, worker_name="gen", lease_ttl_s=30), lambda *_: None)
    yield ctx
    ctx.close()


def exported(name: str) -> float:
    """The worker's sample ``name`` for worker ``gen``, as its metrics endpoint serves the registry."""
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in family.samples:
            if s.name == name and s.labels.get("worker") == "gen":
                return s.value
    raise AssertionError(f"{name} is not exported")


def test_a_regenerated_row_reaches_redis_the_metrics_and_the_heartbeat(context, redis_client, tmp_path) -> None:
    keys = Keys()
    sent: list[list] = []
    create_job(redis_client, keys, "j1", SPEC, [(0, 10)])
    dispatch_pending(redis_client, keys, "j1", lambda _task, args: sent.append(args))
    attempt = context.attempt("j1", 0, sent[0][2])
    assert attempt.claim(30_000).status == "ok"
    events = RedisEvents(attempt, context.meter, context.generation, context.metrics, context.guard, Path(tmp_path))
    events.start(10, 0, 0)
    before = exported("layertap_worker_generated_tokens_total"), exported("layertap_worker_cut_turns_total")

    events.generated(row=0, tokens=300, cut_turns=1)
    events.generated(row=1, tokens=100, cut_turns=0)
    events.generated(row=1, tokens=100, cut_turns=0)  # row 1 regenerated again: the work counts, the row once
    assert events.keep_going()

    assert exported("layertap_worker_generated_tokens_total") - before[0] == 500
    assert exported("layertap_worker_cut_turns_total") - before[1] == 1
    view = job_view(redis_client, keys, "j1")
    assert (view.generated_rows, view.generated_tokens, view.cut_turns) == (2, 400, 1)
    context.heartbeat.beat()
    assert float(redis_client.hget(keys.worker("gen"), "generated_tokens_per_s")) > 0

    redis_client.hset(keys.job("j1"), "state", "cancelled")
    events.generated(row=2, tokens=10, cut_turns=0)
    assert not events.keep_going()  # a report after the job moved on stops the run, as a commit's does


def test_layertap_status_and_the_status_page_show_the_generation_beside_the_capture(
    redis_server, redis_client, services: Services, tmp_path
) -> None:
    keys = Keys()
    coordinator = services.coordinator(redis_server.url, tmp_path / "outputs")
    sent: list[list] = []
    create_job(redis_client, keys, "jg", SPEC, [(0, 10), (10, 20)])
    dispatch_pending(redis_client, keys, "jg", lambda _task, args: sent.append(args))
    attempt = ShardAttempt(redis_client, keys, "jg", 0, sent[0][2], "w1")
    assert attempt.claim(30_000).status == "ok" and attempt.start(0, 0)
    regenerating(redis_client, "jg", keys)
    for row, (new, cut) in enumerate([(1200, 0), (2560, 1), (800, 0)]):
        attempt.row_generated(row, new, cut)
    attempt.sample_done(4000)
    record = {"job": "jg", "shard": 0, "samples_per_s": 0.5, "tokens_per_s": 2000.0, "generated_tokens_per_s": 600.0}
    publish_worker(redis_client, keys, "w1", record, 60_000)

    shown = layertap("status", "jg", env={"LAYERTAP_API_URL": coordinator.url, "COLUMNS": "400"})
    assert shown.returncode == 0, shown.stderr
    # 19 rows left, 2 regenerated ones wait for their capture: 17 to regenerate at 1520 new tokens a row, 43 s.
    assert "3 rows regenerated, 4,560 new tokens, 1 turns cut at max_new_tokens; 600 tokens/s, done in 0m43s" in (
        shown.stdout
    ), shown.stdout
    page = _Page()
    page.feed(chromium(f"{coordinator.url}/status", tmp_path / "profile", "--dump-dom").stdout)
    text = " ".join(page.jobs["jg"]["text"].split())
    assert "regenerated 3 rows, 4,560 tokens" in text and "cut at max_new_tokens 1" in text, text
    assert "generated/s 600" in text and "tokens/s 2,000" in text, text
