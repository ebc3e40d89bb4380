"""The coordinator's moves against a real Redis: reaping dead leases and lost messages, cancel/resume, views."""

from layertap.state.jobs import cancel_job, create_job, reap, resume_job
from layertap.state.keys import FINALIZE_TASK, RUN_SHARD_TASK
from layertap.state.plan import plan_shards
from layertap.state.shards import FinalizeAttempt, ShardAttempt, publish_worker
from layertap.state.views import job_view, list_job_ids
from tests.core.state.support import KEYS, SPEC, new_job


class Outbox:
    """Collects the messages a move sends (the coordinator's Celery client stands here)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, list]] = []

    def __call__(self, task: str, args: list) -> None:
        self.sent.append((task, args))

    def take(self) -> list[tuple[str, list]]:
        out, self.sent = self.sent, []
        return out


def test_reaper_requeues_dead_leases_and_lost_messages_and_nothing_else(redis_client) -> None:
    tokens = new_job(redis_client, rows=40)  # 4 shards, all queued
    alive = ShardAttempt(redis_client, KEYS, "j1", 0, tokens[0], "w1")
    dead = ShardAttempt(redis_client, KEYS, "j1", 1, tokens[1], "w2")
    assert alive.claim(60_000).status == dead.claim(60_000).status == "ok"
    redis_client.delete(KEYS.lease("j1", 1))  # w2 stopped heart-beating long ago
    outbox = Outbox()

    # Messages still waiting in the broker: only the dead runner's shard is sent again.
    reap(redis_client, KEYS, outbox, queue_len=2, queued_grace_ms=0, lease_ms=1000)
    assert [(task, args[1]) for task, args in outbox.take()] == [(RUN_SHARD_TASK, 1)]
    assert dead.sample_done(5) == "lost"

    # The broker queue is empty but the messages are recent: left alone.
    reap(redis_client, KEYS, outbox, queue_len=0, queued_grace_ms=60_000, lease_ms=1000)
    assert outbox.take() == []

    # Empty queue and queued for longer than the grace: those messages were lost (shards 1, 2, 3).
    reap(redis_client, KEYS, outbox, queue_len=0, queued_grace_ms=0, lease_ms=1000)
    assert sorted(args[1] for _, args in outbox.take()) == [1, 2, 3]
    assert alive.sample_done(5) == "running"  # the live worker kept its shard throughout


def test_reaper_dispatches_a_new_finalizer_when_the_old_one_is_gone(redis_client) -> None:
    tokens = new_job(redis_client, rows=10)
    last = ShardAttempt(redis_client, KEYS, "j1", 0, tokens[0], "w1")
    last.claim(10_000)
    assert last.complete(done=10, tokens=100, failed=0, lease_ms=10_000) == "finalize"
    outbox = Outbox()
    reap(redis_client, KEYS, outbox, queue_len=0, queued_grace_ms=0, lease_ms=10_000)
    assert outbox.take() == []  # the finalizer holds its lease

    redis_client.delete(KEYS.finalize_lease("j1"))  # ... and then died
    reap(redis_client, KEYS, outbox, queue_len=0, queued_grace_ms=0, lease_ms=10_000)
    [(task, (job_id, token))] = outbox.take()
    assert (task, job_id) == (FINALIZE_TASK, "j1")
    assert FinalizeAttempt(redis_client, KEYS, "j1", last.token).claim(10_000) is None  # the old one may not
    finalizer = FinalizeAttempt(redis_client, KEYS, "j1", token)
    assert finalizer.claim(10_000) == SPEC
    assert finalizer.finish()
    assert job_view(redis_client, KEYS, "j1").state == "done"


def test_cancel_stops_dispatch_and_resume_sends_every_unfinished_shard_with_new_tokens(redis_client) -> None:
    tokens = new_job(redis_client, rows=30)
    running = ShardAttempt(redis_client, KEYS, "j1", 0, tokens[0], "w1")
    running.claim(60_000)
    assert cancel_job(redis_client, KEYS, "j1") == "running"
    assert cancel_job(redis_client, KEYS, "j1") == "cancelled"  # idempotent
    assert running.sample_done(10) == "cancelled"  # the worker stops at this sample ...
    assert running.release()  # ... and gives the shard back
    assert ShardAttempt(redis_client, KEYS, "j1", 1, tokens[1], "w2").claim(60_000).status == "inactive"
    outbox = Outbox()
    reap(redis_client, KEYS, outbox, queue_len=0, queued_grace_ms=0, lease_ms=1000)
    assert outbox.take() == []  # no dispatch while cancelled

    assert resume_job(redis_client, KEYS, "j1", outbox, lease_ms=1000) == "running"
    new = {args[1]: args[2] for _, args in outbox.take()}
    assert sorted(new) == [0, 1, 2] and not set(new.values()) & set(tokens.values())
    assert ShardAttempt(redis_client, KEYS, "j1", 1, tokens[1], "w2").claim(60_000).status == "stale"
    assert ShardAttempt(redis_client, KEYS, "j1", 1, new[1], "w2").claim(60_000).status == "ok"


def test_resume_of_a_job_whose_shards_are_all_done_finalizes_it(redis_client) -> None:
    tokens = new_job(redis_client, rows=10)
    cancel_job(redis_client, KEYS, "j1")
    last = ShardAttempt(redis_client, KEYS, "j1", 0, tokens[0], "w1")
    redis_client.hset(KEYS.job("j1"), "state", "running")
    last.claim(10_000)
    redis_client.hset(KEYS.job("j1"), "state", "cancelled")  # cancelled while its last shard ran
    assert last.complete(done=10, tokens=10, failed=0, lease_ms=1000) == "done"
    outbox = Outbox()
    assert resume_job(redis_client, KEYS, "j1", outbox, lease_ms=1000) == "finalize"
    assert [task for task, _ in outbox.take()] == [FINALIZE_TASK]


def test_job_view_sums_shards_and_shows_live_workers_with_their_rates(redis_client) -> None:
    tokens = new_job(redis_client, rows=25)
    create_job(redis_client, KEYS, "j0", SPEC, plan_shards(5, 10))
    a = ShardAttempt(redis_client, KEYS, "j1", 0, tokens[0], "w1")
    b = ShardAttempt(redis_client, KEYS, "j1", 1, tokens[1], "w2")
    a.claim(10_000), b.claim(10_000)
    a.start(done=2, tokens=20)
    a.sample_done(7), b.sample_done(5), b.sample_done(5)
    publish_worker(
        redis_client, KEYS, "w1", {"job": "j1", "shard": 0, "samples_per_s": 2.5, "tokens_per_s": 40}, 10_000
    )
    publish_worker(
        redis_client, KEYS, "w3", {"job": "other", "shard": 4, "samples_per_s": 9, "tokens_per_s": 9}, 10_000
    )

    view = job_view(redis_client, KEYS, "j1")
    assert (view.samples_done, view.tokens_done, view.num_rows) == (5, 37, 25)
    assert view.shards == {"running": 2, "queued": 1}
    workers = {w.name: w for w in view.workers}
    assert set(workers) == {"w1", "w2"}  # w3 works on another job
    assert (workers["w1"].samples, workers["w1"].tokens, workers["w1"].alive, workers["w1"].shard) == (1, 7, True, 0)
    assert (workers["w2"].samples, workers["w2"].alive) == (2, False)
    assert view.samples_per_s == 2.5 and view.eta_s == (25 - 5) / 2.5
    assert set(list_job_ids(redis_client, KEYS)) == {"j0", "j1"}
    assert job_view(redis_client, KEYS, "nope") is None


def test_a_shard_released_for_a_celery_retry_waits_for_that_retry_before_counting_as_lost(redis_client) -> None:
    tokens = new_job(redis_client, rows=20)
    early, late = (ShardAttempt(redis_client, KEYS, "j1", n, tokens[n], "w1") for n in (0, 1))
    for attempt in (early, late):
        attempt.claim(10_000)
    assert late.release(retry_in_s=60) and early.release(retry_in_s=0)
    assert redis_client.hmget(KEYS.shard("j1", 1), "state", "token") == ["queued", tokens[1]]
    outbox = Outbox()
    reap(redis_client, KEYS, outbox, queue_len=0, queued_grace_ms=0, lease_ms=1000)
    # The retry of shard 1 is due in a minute: still its own. Shard 0's was due now and is not in the
    # queue: lost, so it is dispatched again under a new token.
    assert [args[1] for _, args in outbox.take()] == [0]
    assert ShardAttempt(redis_client, KEYS, "j1", 1, tokens[1], "w2").claim(10_000).status == "ok"
