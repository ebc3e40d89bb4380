"""A small job for the state tests: 10-row shards, a fixed spec, messages collected instead of sent."""

import json
from pathlib import Path

from redis import Redis

from layertap.state.jobs import create_job, dispatch_pending
from layertap.state.keys import Keys
from layertap.state.model import JobSpec
from layertap.state.plan import plan_shards

KEYS = Keys("t")
SPEC = JobSpec(model=Path("/m"), data=Path("/d.jsonl"), layers=(1, 2), out=Path("/out/job"), shard_size=10)


def new_job(redis: Redis, rows: int = 25, job_id: str = "j1") -> dict[int, str]:
    """Create a job of ``rows`` rows and dispatch it; returns shard -> token of its message."""
    sent: list[tuple[str, list]] = []
    create_job(redis, KEYS, job_id, SPEC, plan_shards(rows, SPEC.shard_size))
    dispatch_pending(redis, KEYS, job_id, lambda task, args: sent.append((task, args)))
    return {args[1]: args[2] for _, args in sent}


def regenerating(redis: Redis, job_id: str = "j1", keys: Keys = KEYS) -> None:
    """Make the job one that regenerates its responses, as a job submitted with ``regenerate`` stores its spec."""
    redis.hset(keys.job(job_id), "spec", json.dumps(SPEC.model_dump(mode="json") | {"regenerate": "all"}))
