"""Shard state changes against a real Redis: tokens guard every move, one completion finalizes."""

from concurrent.futures import ThreadPoolExecutor

from redis import ConnectionPool, Redis
from redis.connection import Connection

from layertap.state.jobs import resume_job
from layertap.state.model import SampleFailure
from layertap.state.plan import plan_shards
from layertap.state.shards import ShardAttempt, renew_lease
from layertap.state.views import job_errors, job_view
from tests.core.state.support import KEYS, SPEC, new_job


def test_plan_shards_cover_every_row_exactly_once() -> None:
    for rows, size in [(1, 1), (25, 10), (30, 10), (37_000, 100), (7, 100)]:
        shards = plan_shards(rows, size)
        covered = [r for start, stop in shards for r in range(start, stop)]
        assert covered == list(range(rows))
        assert all(0 < stop - start <= size for start, stop in shards)


def test_claim_refuses_stale_inactive_and_busy_shards_and_takes_over_a_dead_lease(redis_client) -> None:
    tokens = new_job(redis_client)
    first = ShardAttempt(redis_client, KEYS, "j1", 0, tokens[0], "w1")
    claim = first.claim(lease_ms=10_000)
    assert (claim.status, claim.start, claim.stop, claim.attempts) == ("ok", 0, 10, 1)
    assert claim.spec == SPEC

    # The same message delivered again while w1 heart-beats: busy. Another token: stale.
    assert ShardAttempt(redis_client, KEYS, "j1", 0, tokens[0], "w2").claim(10_000).status == "busy"
    assert ShardAttempt(redis_client, KEYS, "j1", 0, "not-the-token", "w2").claim(10_000).status == "stale"
    assert ShardAttempt(redis_client, KEYS, "j2", 0, tokens[0], "w2").claim(10_000).status == "missing"

    # w1 dies: its lease expires, and Celery's redelivery of the same message may take over.
    redis_client.delete(KEYS.lease("j1", 0))
    takeover = ShardAttempt(redis_client, KEYS, "j1", 0, tokens[0], "w2").claim(10_000)
    assert (takeover.status, takeover.attempts) == ("ok", 2)
    assert redis_client.hget(KEYS.shard("j1", 0), "worker") == "w2"

    # A cancelled job's messages are not run.
    redis_client.hset(KEYS.job("j1"), "state", "cancelled")
    assert ShardAttempt(redis_client, KEYS, "j1", 1, tokens[1], "w1").claim(10_000).status == "inactive"


def test_counts_are_exact_and_a_requeued_attempt_can_no_longer_move_state(redis_client) -> None:
    tokens = new_job(redis_client)
    attempt = ShardAttempt(redis_client, KEYS, "j1", 0, tokens[0], "w1")
    attempt.claim(10_000)
    assert attempt.start(done=4, tokens=400)  # four samples were already in the store
    assert attempt.sample_retired(100) == "running"  # one of them its row no longer gives
    assert attempt.sample_done(40) == "running"
    bad = SampleFailure(row=7, sample_id="s7", reason="non-finite values", kind="capture")
    assert attempt.sample_failed(bad) == "running"
    assert attempt.sample_failed(bad) == "running"  # recorded twice, counted once
    shard = redis_client.hgetall(KEYS.shard("j1", 0))
    assert (shard["done"], shard["tokens"], shard["failed"]) == ("4", "340", "1")
    assert job_errors(redis_client, KEYS, "j1") == [bad]

    # The lease expires and the reaper's move hands the shard to a new dispatch: the old attempt is lost.
    redis_client.delete(KEYS.lease("j1", 0))
    resume_job(redis_client, KEYS, "j1", lambda *_: None, lease_ms=1000)
    assert attempt.sample_done(40) == "lost"
    assert attempt.sample_retired(40) == "lost"
    assert attempt.complete(done=10, tokens=1, failed=0, lease_ms=1000) == "lost"
    assert not renew_lease(redis_client, KEYS, "j1", 0, tokens[0], 1000)
    assert redis_client.hget(KEYS.shard("j1", 0), "done") == "4"


def test_exactly_one_of_many_concurrent_completions_wins_the_finalize(redis_client) -> None:
    tokens = new_job(redis_client, rows=400)  # 40 shards
    attempts = [ShardAttempt(redis_client, KEYS, "j1", n, t, f"w{n % 4}") for n, t in tokens.items()]
    for a in attempts:
        assert a.claim(60_000).status == "ok"
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda a: a.complete(done=10, tokens=100, failed=0, lease_ms=60_000), attempts))
    assert outcomes.count("finalize") == 1 and outcomes.count("done") == 39
    winner = attempts[outcomes.index("finalize")]
    job = redis_client.hgetall(KEYS.job("j1"))
    assert (job["state"], job["finalize_token"]) == ("finalizing", winner.token)
    assert redis_client.get(KEYS.finalize_lease("j1")) == winner.token
    view = job_view(redis_client, KEYS, "j1")
    assert (view.samples_done, view.tokens_done, view.shards) == (400, 4000, {"done": 40})


def test_failed_shards_fail_the_job_and_resume_dispatches_them_again(redis_client) -> None:
    tokens = new_job(redis_client)
    done = ShardAttempt(redis_client, KEYS, "j1", 0, tokens[0], "w1")
    done.claim(10_000)
    assert done.complete(done=10, tokens=10, failed=0, lease_ms=1000) == "done"
    for n in (1, 2):
        failing = ShardAttempt(redis_client, KEYS, "j1", n, tokens[n], "w1")
        failing.claim(10_000)
        assert failing.fail("ServerError: the server died") == ("failed" if n == 1 else "job-failed")
    job = redis_client.hgetall(KEYS.job("j1"))
    assert job["state"] == "failed" and "shard 2: ServerError" in job["error"]

    sent: list[list] = []
    assert resume_job(redis_client, KEYS, "j1", lambda task, args: sent.append(args), lease_ms=1000) == "running"
    assert sorted(args[1] for args in sent) == [1, 2]
    assert all(args[2] not in tokens.values() for args in sent)  # fresh tokens
    assert redis_client.hget(KEYS.job("j1"), "state") == "running"
    assert not redis_client.exists(KEYS.failed("j1"))
    assert redis_client.hget(KEYS.shard("j1", 1), "attempts") == "0"  # a fresh budget of claims


class CountingConnection(Connection):
    """Counts packets sent to Redis: one per command, one per whole pipeline (a round trip each)."""

    sent = 0

    def send_packed_command(self, command, check_health=True):
        CountingConnection.sent += 1
        return super().send_packed_command(command, check_health)


def test_each_per_sample_state_change_is_one_round_trip(redis_server, redis_client) -> None:
    tokens = new_job(redis_client)
    pool = ConnectionPool(connection_class=CountingConnection, port=redis_server.port, decode_responses=True)
    counted = Redis(connection_pool=pool)
    attempt = ShardAttempt(counted, KEYS, "j1", 0, tokens[0], "w1")
    attempt.claim(10_000)
    for _ in range(3):  # warm up: a script's first call on a server may cost a SCRIPT LOAD
        attempt.sample_done(10)
        attempt.sample_failed(SampleFailure(row=1, sample_id="s1", reason="x", kind="capture"))
        attempt.row_generated(1, 10, 0)
    CountingConnection.sent = 0
    for n in range(100):
        attempt.row_generated(n, 10, 0)
        attempt.sample_done(10)
        attempt.sample_failed(SampleFailure(row=n, sample_id=f"s{n}", reason="x", kind="capture"))
    assert CountingConnection.sent == 300


def test_a_regenerated_row_counts_once_when_a_replacing_attempt_regenerates_it(redis_client) -> None:
    tokens = new_job(redis_client)
    first = ShardAttempt(redis_client, KEYS, "j1", 0, tokens[0], "w1")
    assert first.claim(10_000).status == "ok" and first.start(0, 0)
    assert first.row_generated(0, 50, 0) == "running"
    assert first.sample_done(80) == "running"  # row 0 is stored
    assert first.row_generated(1, 70, 1) == "running"  # row 1 is regenerated (one turn cut), then w1 dies

    redis_client.delete(KEYS.lease("j1", 0))
    sent: list[list] = []
    resume_job(redis_client, KEYS, "j1", lambda _task, args: sent.append(args), lease_ms=1000)
    assert first.row_generated(2, 40, 0) == "lost"  # the dead attempt's late reports move nothing
    second = ShardAttempt(redis_client, KEYS, "j1", 0, sent[0][2], "w2")
    assert second.claim(10_000).status == "ok" and second.start(1, 80)
    assert second.row_generated(1, 70, 1) == "running"  # row 1 regenerated again, the same text: counted once
    assert second.row_generated(2, 30, 0) == "running"
    view = job_view(redis_client, KEYS, "j1")
    assert (view.generated_rows, view.generated_tokens, view.cut_turns) == (3, 150, 1)

    assert second.row_generated(1, 60, 0) == "running"  # told again with other figures: they replace the old ones
    view = job_view(redis_client, KEYS, "j1")
    assert (view.generated_rows, view.generated_tokens, view.cut_turns) == (3, 140, 0)


def test_a_job_that_does_not_regenerate_counts_no_generation(redis_client) -> None:
    new_job(redis_client)
    view = job_view(redis_client, KEYS, "j1")
    assert not view.regenerates
    assert (view.generated_rows, view.generated_tokens, view.cut_turns, view.generation_eta_s) == (0, 0, 0, 0.0)
