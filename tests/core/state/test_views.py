"""A job's view against a real Redis: a regenerating job's generation counts and its ETA (`JobView.eta_s`); a
stream's view (`stream_views`): held, paused, dead letters."""

import time

import pytest

from layertap.progress import stream_line
from layertap.state.shards import ShardAttempt, publish_worker
from layertap.state.views import job_view, settled_samples, stream_views
from tests.core.state.support import KEYS, new_job, regenerating


def live(redis, *, samples_per_s: float, generated_tokens_per_s: float) -> None:
    """The record w1's heartbeat publishes while it works on shard 0 of j1."""
    record = {"job": "j1", "shard": 0, "samples_per_s": samples_per_s, "tokens_per_s": samples_per_s * 100,
              "generated_tokens_per_s": generated_tokens_per_s}  # fmt: skip
    publish_worker(redis, KEYS, "w1", record, 30_000)


def test_a_regenerating_jobs_eta_is_its_slower_stream_and_a_lower_bound_while_capture_waits(redis_client) -> None:
    tokens = new_job(redis_client, rows=25)
    attempt = ShardAttempt(redis_client, KEYS, "j1", 0, tokens[0], "w1")
    assert attempt.claim(10_000).status == "ok" and attempt.start(0, 0)
    regenerating(redis_client)
    for row in range(5):  # 5 rows regenerated, 100 new tokens each; 2 of them stored
        attempt.row_generated(row, 100, 1 if row == 4 else 0)
    attempt.sample_done(300)
    attempt.sample_done(300)

    live(redis_client, samples_per_s=0.5, generated_tokens_per_s=50.0)
    view = job_view(redis_client, KEYS, "j1")
    assert view.regenerates and view.generated_tokens_per_s == 50.0
    # 23 rows left, 3 of them regenerated and waiting for their capture: 20 to regenerate, 100 tokens each.
    assert view.rows_to_generate == 20
    assert view.generation_eta_s == pytest.approx(20 * 100 / 50.0)
    assert view.eta_s == pytest.approx(23 / 0.5)  # capture is the slower stream

    live(redis_client, samples_per_s=2.0, generated_tokens_per_s=50.0)
    assert job_view(redis_client, KEYS, "j1").eta_s == pytest.approx(40.0)  # now generation is

    live(redis_client, samples_per_s=0.0, generated_tokens_per_s=50.0)
    assert job_view(redis_client, KEYS, "j1").eta_s == pytest.approx(40.0)  # capture waits: generation's time

    live(redis_client, samples_per_s=0.5, generated_tokens_per_s=0.0)
    view = job_view(redis_client, KEYS, "j1")
    assert view.generation_eta_s is None and view.eta_s == pytest.approx(46.0)  # a lower bound, as documented

    redis_client.delete(KEYS.worker("w1"))  # nothing moves
    assert job_view(redis_client, KEYS, "j1").eta_s is None


def test_without_regeneration_the_eta_is_rows_left_over_the_sample_rate(redis_client) -> None:
    tokens = new_job(redis_client, rows=25)
    attempt = ShardAttempt(redis_client, KEYS, "j1", 0, tokens[0], "w1")
    assert attempt.claim(10_000).status == "ok" and attempt.start(0, 0)
    attempt.sample_done(300)
    live(redis_client, samples_per_s=0.5, generated_tokens_per_s=0.0)
    view = job_view(redis_client, KEYS, "j1")
    assert not view.regenerates and view.eta_s == pytest.approx(24 / 0.5)
    live(redis_client, samples_per_s=0.0, generated_tokens_per_s=0.0)
    assert job_view(redis_client, KEYS, "j1").eta_s is None


def test_a_streams_view_counts_the_producers_held_now_and_leaves_a_dead_ones_word_out(redis_client) -> None:
    now, name = round(time.time() * 1000), "s"
    redis_client.zadd(KEYS.streams, {name: now})
    redis_client.hset(KEYS.stream_run(name), mapping={"bound": 4, "ended": 0, "held_s": 2.5})
    redis_client.hset(KEYS.stream_current(name), mapping={f"s{i}": f"h{i}" for i in range(10)})
    redis_client.hset(KEYS.stream_acked(name), mapping={f"s{i}": "c" for i in range(3)})
    # One producer waits at its bound (3 s so far, said 0.5 s ago); another was killed waiting (said a minute ago).
    redis_client.hset(KEYS.stream_held(name), mapping={"p1": f"{now - 3_000} {now - 500}",
                                                       "p0": f"{now - 70_000} {now - 60_000}"})  # fmt: skip
    (view,) = stream_views(redis_client, KEYS)
    assert (view.put, view.acked, view.in_flight, view.bound, view.held, view.state) == (10, 3, 7, 4, 1, "held")
    assert 2.5 + 3.0 <= view.held_s < 2.5 + 60  # the dead producer's wait not counted
    redis_client.hdel(KEYS.stream_held(name), "p1")
    redis_client.hset(KEYS.stream_run(name), "ended", 1)
    assert stream_views(redis_client, KEYS)[0].state == "draining"
    redis_client.hset(KEYS.stream_acked(name), mapping={f"s{i}": "c" for i in range(10)})
    assert stream_views(redis_client, KEYS)[0].state == "done"


def test_a_streams_view_counts_dead_letters_settled_not_delivered_and_says_paused(redis_client) -> None:
    name = "s"
    redis_client.zadd(KEYS.streams, {name: round(time.time() * 1000)})
    redis_client.hset(KEYS.stream_run(name), mapping={"bound": 4, "ended": 0, "paused": 1})
    redis_client.hset(KEYS.stream_current(name), mapping={f"s{i}": f"h{i}" for i in range(5)})
    redis_client.hset(KEYS.stream_acked(name), mapping={f"s{i}": "c" for i in range(3)})
    redis_client.hset(KEYS.stream_dead(name), "s3", '{"why": "input_ids differ", "group": "g", "consumer": "c"}')
    (view,) = stream_views(redis_client, KEYS)
    assert (view.put, view.acked, view.dead, view.in_flight, view.state) == (5, 3, 1, 1, "paused")
    assert settled_samples(redis_client, KEYS, name, ["s0", "s3", "s4"]) == (["s0"], ["s3"])
    redis_client.hdel(KEYS.stream_run(name), "paused")
    redis_client.hset(KEYS.stream_run(name), "ended", 1)
    redis_client.hset(KEYS.stream_acked(name), "s4", "c")
    (view,) = stream_views(redis_client, KEYS)
    assert view.state == "done" and stream_line(view) == (
        "stream s: 5 put, 4 acked, 1 dead-lettered, 0 in flight (bound 4), every one settled, not all delivered, "
        "held 0.0s"
    )
