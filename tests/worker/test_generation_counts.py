"""A regenerated row, as the pipeline reports it to a worker (`RedisEvents.generated`): counted once in Redis, in the
worker's metrics (what its ``/metrics`` serves) and in the generation rate its heartbeat publishes."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from layertap.state.jobs import create_job, dispatch_pending
from layertap.state.keys import Keys
from layertap.state.views import job_view
from tests.state.support import SPEC
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
