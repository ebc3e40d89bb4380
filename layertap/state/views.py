"""Read-only views of jobs and streams for the API and the CLI: progress summed over shards, per-worker, errors;
each stream's samples put, acked, dead-lettered and in flight.

Each view costs a fixed number of round trips (pipelines), whatever the job's size.
"""

from __future__ import annotations

import json
import time
from collections import Counter

from redis import Redis

from layertap.state.keys import Keys
from layertap.state.model import AuditView, JobView, SampleFailure, StreamView, WorkerView


def list_job_ids(redis: Redis, keys: Keys, *, limit: int = 100) -> list[str]:
    """Newest first."""
    return list(redis.zrevrange(keys.jobs, 0, limit - 1))


def job_view(redis: Redis, keys: Keys, job_id: str) -> JobView | None:
    """A job's progress and workers in two round trips; None if the job is unknown."""
    pipe = redis.pipeline(transaction=False)
    pipe.hgetall(keys.job(job_id))
    pipe.zscore(keys.jobs, job_id)
    pipe.hgetall(keys.job_workers(job_id))
    pipe.smembers(keys.workers)
    pipe.hgetall(keys.audit(job_id))
    job, created, per_worker, names, audit = pipe.execute()
    if not job:
        return None
    num_shards = int(job["num_shards"])
    spec = json.loads(job["spec"]) if job.get("spec") else {}
    names = sorted(names)
    pipe = redis.pipeline(transaction=False)
    for n in range(num_shards):
        pipe.hmget(keys.shard(job_id, n), "state", "done", "tokens", "failed", "generated_rows", "generated", "cut")
    for name in names:
        pipe.hgetall(keys.worker(name))
    replies = pipe.execute()
    view = JobView(
        job_id=job_id,
        state=job["state"],
        out=job["out"],
        created_ms=int(created or 0),
        finished_ms=int(job["finished_ms"]) if job.get("finished_ms") else None,
        num_rows=int(job["num_rows"]),
        num_shards=num_shards,
        error=job.get("error") or None,
        audit=AuditView.of(audit),
        store_dtype=spec.get("store_dtype", "bfloat16"),
        bytes_per_token=int(job.get("bytes_per_token") or 0),
        regenerates=spec.get("regenerate") is not None,
    )
    states: Counter[str] = Counter()
    for state, done, tokens, failed, generated_rows, generated, cut in replies[:num_shards]:
        states[state or "missing"] += 1
        view.samples_done += int(done or 0)
        view.tokens_done += int(tokens or 0)
        view.samples_failed += int(failed or 0)
        view.generated_rows += int(generated_rows or 0)
        view.generated_tokens += int(generated or 0)
        view.cut_turns += int(cut or 0)
    view.shards = dict(states)
    view.workers = _workers(job_id, per_worker, names, replies[num_shards:])
    return view


def _workers(job_id: str, per_worker: dict[str, str], names: list[str], live: list[dict]) -> list[WorkerView]:
    """Workers that committed samples of this job, or are working on it now."""
    views: dict[str, WorkerView] = {}
    for field, value in per_worker.items():
        name, _, what = field.rpartition(":")
        view = views.setdefault(name, WorkerView(name=name))
        setattr(view, what, int(value))
    for name, info in zip(names, live, strict=True):
        if not info or info.get("job") != job_id:
            continue
        view = views.setdefault(name, WorkerView(name=name))
        view.alive = True
        view.shard = int(info["shard"]) if info.get("shard", "") != "" else None
        view.samples_per_s = float(info.get("samples_per_s", 0.0))
        view.tokens_per_s = float(info.get("tokens_per_s", 0.0))
        view.generated_tokens_per_s = float(info.get("generated_tokens_per_s", 0.0))
    return sorted(views.values(), key=lambda w: w.name)


def job_errors(redis: Redis, keys: Keys, job_id: str) -> list[SampleFailure] | None:
    """Every row of the job that produced no sample, by row number; None if the job is unknown."""
    num_shards = redis.hget(keys.job(job_id), "num_shards")
    if num_shards is None:
        return None
    pipe = redis.pipeline(transaction=False)
    for n in range(int(num_shards)):
        pipe.hvals(keys.errors(job_id, n))
    failures = [SampleFailure(**json.loads(raw)) for values in pipe.execute() for raw in values]
    return sorted(failures, key=lambda f: f.row)


def live_workers(redis: Redis, keys: Keys) -> dict[str, dict[str, str]]:
    """Name -> record (state, reason, job, shard, rates, host, free bytes...) of every worker that
    heart-beats now, by name; two round trips."""
    names = sorted(redis.smembers(keys.workers))
    pipe = redis.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(keys.worker(name))
    return {name: record for name, record in zip(names, pipe.execute(), strict=True) if record}


def stream_views(redis: Redis, keys: Keys, *, limit: int = 20) -> list[StreamView]:
    """The streams whose producers opened them last, newest first, in two round trips: CLI runs and jobs alike,
    whatever process puts into them. ``redis`` decodes its replies."""
    names = redis.zrevrange(keys.streams, 0, limit - 1)
    pipe = redis.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(keys.stream_run(name))
        pipe.hlen(keys.stream_current(name))  # distinct samples put: a resumed run's puts again count once
        pipe.hlen(keys.stream_acked(name))
        pipe.hlen(keys.stream_dead(name))
        pipe.hgetall(keys.stream_held(name))
    replies, now_ms = pipe.execute(), round(time.time() * 1000)
    return [StreamView.of(name, *replies[5 * i : 5 * i + 5], now_ms) for i, name in enumerate(names)]


def settled_samples(redis: Redis, keys: Keys, name: str, sample_ids: list[str]) -> tuple[list[str], list[str]]:
    """Which of ``sample_ids`` are settled, in one round trip: (delivered: acked by every group they wait for, dead:
    dead-lettered by a consumer that could not use them). A producer waits for neither once settled."""
    with redis.pipeline(transaction=False) as pipe:
        pipe.hmget(keys.stream_acked(name), sample_ids)
        pipe.hmget(keys.stream_dead(name), sample_ids)
        acked, dead = pipe.execute()
    return ([s for s, by in zip(sample_ids, acked, strict=True) if by is not None],
            [s for s, why in zip(sample_ids, dead, strict=True) if why is not None])  # fmt: skip
