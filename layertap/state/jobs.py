"""The coordinator's state changes: create a job, dispatch its shards, cancel, resume, reap; a cancelled job's
stream reads ``paused`` to its consumers until the job resumes.

Messages are sent through ``send(task_name, args)`` (the coordinator's Celery client), always AFTER
the state change that issued their token: a message whose token is not current is ignored by the
worker, so a crash between the two leaves at worst a shard that the reaper dispatches again.
Round trips do not grow with the number of samples: a few per call, plus one send per shard.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from redis import Redis
from redis.client import Pipeline
from redis.exceptions import RedisError

from layertap.state import scripts
from layertap.state.keys import FINALIZE_TASK, RUN_SHARD_TASK, Keys
from layertap.state.model import JobSpec

log = logging.getLogger(__name__)

Send = Callable[[str, list], None]


def create_job(
    redis: Redis, keys: Keys, job_id: str, spec: JobSpec, shards: Sequence[tuple[int, int]], *, bytes_per_token: int = 0
) -> None:
    """Write the job and all its shards as ``pending`` (and its audit, if it asks for one) in one transaction;
    ``bytes_per_token`` (what its store keeps per token) lets its views say how much it has stored."""
    pipe = redis.pipeline(transaction=True)
    pipe.hset(
        keys.job(job_id),
        mapping={
            "state": "running",
            "spec": spec.model_dump_json(),
            "out": str(spec.out),
            "num_rows": shards[-1][1] if shards else 0,
            "num_shards": len(shards),
            "finalize_token": "",
            "error": "",
            "bytes_per_token": bytes_per_token,
        },
    )
    pipe.zadd(keys.jobs, {job_id: server_time_ms(redis)})
    for n, (start, stop) in enumerate(shards):
        pipe.hset(keys.shard(job_id, n), mapping=shard_fields(start, stop))
    pipe.sadd(keys.open(job_id), *range(len(shards)))
    request_audit(pipe, keys, job_id, spec)
    pipe.execute()


def request_audit(pipe: Pipeline, keys: Keys, job_id: str, spec: JobSpec) -> None:
    """The job's audit as ``pending``, if it asks for one (a worker claims it once the job has ended)."""
    if spec.audit_samples:
        pipe.hset(keys.audit(job_id), mapping={"state": "pending", "samples": spec.audit_samples})


def shard_fields(start: int, stop: int) -> dict[str, int | str]:
    """A fresh shard hash: pending, no token, nothing counted."""
    return {"start": start, "stop": stop, "state": "pending", "token": "", "done": 0, "tokens": 0, "failed": 0}


def server_time_ms(redis: Redis) -> int:
    """Milliseconds on the Redis server's clock (the one every script uses)."""
    seconds, micros = redis.time()
    return seconds * 1000 + micros // 1000


def job_exists(redis: Redis, keys: Keys, job_id: str) -> bool:
    return bool(redis.exists(keys.job(job_id)))


def dispatch_pending(redis: Redis, keys: Keys, job_id: str, send: Send) -> int:
    """Give every pending shard of a running job a token, then send its message; returns how many."""
    open_shards = sorted(int(s) for s in redis.smembers(keys.open(job_id)))
    if not open_shards:
        return 0
    pipe = redis.pipeline(transaction=False)
    for n in open_shards:
        scripts.DISPATCH([keys.job(job_id), keys.shard(job_id, n), keys.seq], client=pipe)
    tokens = pipe.execute()
    sent = 0
    for n, token in zip(open_shards, tokens, strict=True):
        if token is not None:
            send(RUN_SHARD_TASK, [job_id, n, token])
            sent += 1
    return sent


def cancel_job(redis: Redis, keys: Keys, job_id: str) -> str:
    """Stop dispatch: workers skip queued messages and release running shards at the next sample.

    Returns the state before (``running``/``failed`` were cancelled; anything else was left alone).
    """
    before = scripts.CANCEL([keys.job(job_id)], client=redis)
    if before in ("running", "failed"):
        pause_stream(redis, keys, job_id, paused=True)
    return before


def resume_job(redis: Redis, keys: Keys, job_id: str, send: Send, *, lease_ms: int) -> str:
    """Continue a job: failed shards, and shards whose worker or message is gone, are dispatched again.

    Returns ``running`` (shards dispatched), ``finalize`` (every shard was done: finalize sent), or the
    state that cannot be resumed (``done``, ``finalizing``, ``missing``).
    """
    before = redis.hget(keys.job(job_id), "state")
    reply = scripts.RESUME(
        [keys.job(job_id), keys.open(job_id), keys.seq, keys.finalize_lease(job_id), keys.failed(job_id)],
        [lease_ms],
        client=redis,
    )
    if reply[0] in ("finalize", "running"):
        pause_stream(redis, keys, job_id, paused=False)
    if reply[0] == "finalize":
        send(FINALIZE_TASK, [job_id, reply[1]])
        return "finalize"
    if reply[0] != "running":
        return reply[0]
    # A cancelled job's queued messages were skipped by workers; a failed shard gave up. Both go back.
    again = ("failed", "queued") if before in ("cancelled", "failed") else ("failed",)
    _requeue(redis, keys, job_id, again, running_too=True)
    dispatch_pending(redis, keys, job_id, send)
    return "running"


def pause_stream(redis: Redis, keys: Keys, job_id: str, *, paused: bool) -> None:
    """Mark the job's stream ``paused`` (its consumers wait for the job instead of ending), or running again. The
    stream is named as its producers name it (`layertap.stream.sink.stream_name`: the spec's ``stream_name``, else
    its output folder's name), on the spec's ``stream_redis_url``, else this Redis (the one the streams view reads);
    only a stream a producer opened is marked, and a stream Redis that does not answer only costs a warning."""
    raw_spec, out = redis.hmget(keys.job(job_id), ["spec", "out"])
    if raw_spec is None or out is None:
        return
    spec = json.loads(raw_spec)
    run = keys.stream_run(spec.get("stream_name") or Path(out).name)
    client = (
        Redis.from_url(spec["stream_redis_url"], socket_connect_timeout=3) if spec.get("stream_redis_url") else redis
    )
    try:
        if not client.exists(run):
            return
        if paused:
            client.hset(run, "paused", 1)
        else:
            client.hdel(run, "paused")
    except RedisError as exc:
        log.warning("job %s: its stream %s could not be marked %s (%s)", job_id, run,
                    "paused" if paused else "running", exc)  # fmt: skip
    finally:
        if client is not redis:
            client.close()


def _open_shards(redis: Redis, keys: Keys, job_id: str) -> list[tuple[int, str, str, int, bool]]:
    """(shard, state, token, queued_ms, lease alive) for every open shard: two round trips."""
    open_shards = sorted(int(s) for s in redis.smembers(keys.open(job_id)))
    pipe = redis.pipeline(transaction=False)
    for n in open_shards:
        pipe.hmget(keys.shard(job_id, n), "state", "token", "queued_ms")
        pipe.exists(keys.lease(job_id, n))
    replies = pipe.execute()
    out = []
    for i, n in enumerate(open_shards):
        state, token, queued_ms = replies[2 * i]
        out.append((n, state or "", token or "", int(queued_ms or 0), bool(replies[2 * i + 1])))
    return out


def _requeue(
    redis: Redis,
    keys: Keys,
    job_id: str,
    states: tuple[str, ...],
    *,
    running_too: bool = False,
    older_than_ms: int | None = None,
) -> int:
    """Move open shards in ``states`` (queued ones only if queued at or before ``older_than_ms``), and
    with ``running_too`` running shards whose lease expired, back to pending."""
    shards = _open_shards(redis, keys, job_id)
    pipe = redis.pipeline(transaction=False)
    moved = []
    for n, state, token, queued_ms, alive in shards:
        if alive:
            continue
        dead_runner = running_too and state == "running"
        lost = state in states and (older_than_ms is None or state != "queued" or queued_ms <= older_than_ms)
        if dead_runner or lost:
            scripts.REQUEUE([keys.shard(job_id, n), keys.lease(job_id, n)], [token, state], client=pipe)
            moved.append(n)
    if not moved:
        return 0
    count = sum(pipe.execute())
    if count:
        log.info("job %s: %d shards back to pending (%s)", job_id, count, ", ".join(map(str, moved)))
    return count


def reap(redis: Redis, keys: Keys, send: Send, *, queue_len: int, queued_grace_ms: int, lease_ms: int) -> None:
    """One pass of the coordinator's watchdog over every active job.

    Running shards whose lease expired (the worker stopped heart-beating) go back to pending, and
    so do queued shards whose message seems lost (queued longer than the grace while the broker
    queue is empty); pending shards are dispatched. A finalizing job whose finalizer is gone gets
    a new finalize message.
    """
    prune_workers(redis, keys)
    job_ids = redis.zrange(keys.jobs, 0, -1)
    if not job_ids:
        return
    pipe = redis.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.hget(keys.job(job_id), "state")
    states = pipe.execute()
    older_than = server_time_ms(redis) - queued_grace_ms if queue_len == 0 else None
    for job_id, state in zip(job_ids, states, strict=True):
        if state == "running":
            lost_queued = ("queued",) if older_than is not None else ()
            _requeue(redis, keys, job_id, lost_queued, running_too=True, older_than_ms=older_than)
            dispatch_pending(redis, keys, job_id, send)
        elif state == "finalizing":
            token = scripts.REFINALIZE(
                [keys.job(job_id), keys.finalize_lease(job_id), keys.seq], [lease_ms], client=redis
            )
            if token is not None:
                log.info("job %s: finalizer gone, finalize dispatched again", job_id)
                send(FINALIZE_TASK, [job_id, token])


def prune_workers(redis: Redis, keys: Keys) -> int:
    """Forget workers whose record expired (they stopped heart-beating); their per-job totals stay."""
    names = sorted(redis.smembers(keys.workers))
    if not names:
        return 0
    pipe = redis.pipeline(transaction=False)
    for name in names:
        pipe.exists(keys.worker(name))
    gone = [name for name, alive in zip(names, pipe.execute(), strict=True) if not alive]
    if gone:
        redis.srem(keys.workers, *gone)
    return len(gone)


def delete_job(redis: Redis, keys: Keys, job_id: str) -> int:
    """Remove every key of a job (before rebuilding it from its store)."""
    doomed = [keys.job(job_id), *redis.scan_iter(match=keys.job_pattern(job_id), count=1000)]
    pipe = redis.pipeline(transaction=True)
    pipe.delete(*doomed)
    pipe.zrem(keys.jobs, job_id)
    return pipe.execute()[0]
