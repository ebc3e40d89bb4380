"""A stream's consumer groups in Redis (`scripts.STREAM_JOIN`, `STREAM_ACK`, `STREAM_NACK`), against a real Redis:
a sample waits for every group registered at or before its entry, exactly one ack completes it, a dead letter
settles it for every group; and a job's cancel pauses its stream, its resume runs it again."""

import json
import time

from redis import Redis

from layertap.state import scripts
from layertap.state.jobs import cancel_job, resume_job
from tests.core.state.support import KEYS, new_job

NAME = "s"


def join(redis: Redis, group: str) -> None:
    scripts.STREAM_JOIN([KEYS.stream(NAME), KEYS.stream_groups(NAME)], [group], client=redis)


def group_keys() -> list[str]:
    return [KEYS.stream(NAME), KEYS.stream_groups(NAME), KEYS.stream_acked(NAME), KEYS.stream_dead(NAME)]


def put(redis: Redis, sample_id: str) -> str:
    """The entry a producer adds for ``sample_id``, read by every group (as their consumers' XREADGROUP does)."""
    entry = redis.xadd(KEYS.stream(NAME), {"sample_id": sample_id})
    for group in redis.hkeys(KEYS.stream_groups(NAME)):
        redis.xreadgroup(group, "c", {KEYS.stream(NAME): ">"})
    return entry


def ack(redis: Redis, group: str, entry: str, sample_id: str) -> list[int]:
    return scripts.STREAM_ACK(group_keys(), [group, entry, sample_id, f"{group}-c"], client=redis)


def test_a_sample_is_delivered_by_the_ack_that_completes_the_groups_registered_when_it_was_put(redis_client) -> None:
    join(redis_client, "trainers")
    join(redis_client, "stream-verify")
    join(redis_client, "trainers")  # joining again keeps its registration
    first = put(redis_client, "a")
    assert ack(redis_client, "trainers", first, "a") == [1, 0]  # stream-verify owes it still
    assert ack(redis_client, "trainers", first, "a") == [0, 0]  # an ack again (a reclaimed entry) completes nothing
    assert not redis_client.hexists(KEYS.stream_acked(NAME), "a")
    assert ack(redis_client, "stream-verify", first, "a") == [1, 1]  # the last: it records it, removes the object
    assert redis_client.hget(KEYS.stream_acked(NAME), "a") == "stream-verify-c"
    assert ack(redis_client, "stream-verify", first, "a") == [0, 0]

    second = put(redis_client, "b")
    time.sleep(0.005)  # a group registered in the entry's millisecond owes it
    join(redis_client, "late")  # registered after the sample was put: it does not owe an ack of it
    assert ack(redis_client, "trainers", second, "b") == [1, 0]
    assert ack(redis_client, "stream-verify", second, "b") == [1, 1]
    assert redis_client.xpending(KEYS.stream(NAME), "trainers")["pending"] == 0


def test_a_dead_letter_settles_its_sample_for_every_group_once(redis_client) -> None:
    join(redis_client, "trainers")
    join(redis_client, "stream-verify")
    entry = put(redis_client, "a")
    assert ack(redis_client, "trainers", entry, "a") == [1, 0]
    why = json.dumps({"why": "input_ids differ", "group": "stream-verify", "consumer": "v"})
    assert scripts.STREAM_NACK(group_keys(), ["stream-verify", entry, "a", why], client=redis_client) == 1
    assert scripts.STREAM_NACK(group_keys(), ["trainers", entry, "a", why], client=redis_client) == 0  # once
    assert json.loads(redis_client.hget(KEYS.stream_dead(NAME), "a"))["why"] == "input_ids differ"
    assert not redis_client.hexists(KEYS.stream_group_acked(NAME, "trainers"), "a")  # no group counts it twice
    assert ack(redis_client, "trainers", entry, "a") == [0, 0]  # settled: an ack after delivers nothing
    assert not redis_client.hexists(KEYS.stream_acked(NAME), "a")
    for group in ("trainers", "stream-verify"):
        assert redis_client.xpending(KEYS.stream(NAME), group)["pending"] == 0


def test_a_cancelled_jobs_stream_is_paused_until_the_job_resumes(redis_client) -> None:
    new_job(redis_client)  # its stream is named after its output folder (`stream_name`), here "job"
    run = KEYS.stream_run("job")
    cancel_job(redis_client, KEYS, "j1")
    assert not redis_client.exists(run)  # no producer opened it: nothing to mark
    resume_job(redis_client, KEYS, "j1", lambda *_: None, lease_ms=1000)
    redis_client.hset(run, mapping={"ended": 0, "bound": 4})  # as a shard attempt's producer opens it
    cancel_job(redis_client, KEYS, "j1")
    assert redis_client.hget(run, "paused") == "1"
    resume_job(redis_client, KEYS, "j1", lambda *_: None, lease_ms=1000)
    assert redis_client.hget(run, "paused") is None and redis_client.hget(run, "bound") == "4"
