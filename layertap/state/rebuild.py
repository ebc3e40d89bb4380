"""Recreate a job's Redis state from its output store, after Redis lost its data.

The store is the ground truth: a sample counts as done when its index record exists and its file
passes ``OutputStore.check``; a row counts as failed when the store's error logs hold it and it was
not committed since. A shard whose rows are all accounted for is done; the others are pending, and
the coordinator's reaper dispatches them (the job is written as ``running``). A regenerating job's
generation counts are those of its done samples' regenerated rows (their tokens as logged with them,
turns cut at max_new_tokens as their ``finish_reason`` says).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from redis import Redis

from layertap.errors import StoreError
from layertap.state.jobs import delete_job, job_exists, request_audit, server_time_ms, shard_fields
from layertap.state.keys import Keys
from layertap.state.model import SampleFailure
from layertap.state.plan import job_of_store, plan_shards
from layertap.store.index import SampleRecord
from layertap.store.store import CheckLevel, OutputStore


@dataclass(frozen=True, slots=True)
class Rebuilt:
    """What the rebuild found: the job, its state, and how many shards and samples are done."""

    job_id: str
    state: str
    shards_done: int
    num_shards: int
    samples_done: int
    samples_failed: int


def rebuild_job(
    redis: Redis, keys: Keys, out: Path, *, check_level: CheckLevel = "quick", replace: bool = False
) -> Rebuilt:
    """Write the job recorded in ``out/job.json`` back into Redis from the store's index and error logs.

    Raises StoreError when ``out`` was not made by a job, or when Redis still knows the job and
    ``replace`` is not set.
    """
    found = job_of_store(out)
    if found is None:
        raise StoreError(f"{out} has no job.json: it was not made by a distributed job (use `layertap extract`)")
    job_id, spec = found
    if job_exists(redis, keys, job_id) and not replace:
        raise StoreError(f"Redis still holds job {job_id}; pass --replace to overwrite it from the store")
    store = OutputStore.open_existing(out)
    shards = plan_shards(store.manifest.dataset_rows, spec.shard_size)
    done = [[0, 0] for _ in shards]  # per shard: samples, tokens
    failures: list[list[SampleFailure]] = [[] for _ in shards]
    counted = {rec.sample_id: rec for rec in store.records().values() if not store.check(rec, check_level)}
    for rec in counted.values():
        done[rec.index // spec.shard_size][0] += 1
        done[rec.index // spec.shard_size][1] += rec.num_tokens
    generated = _generation(store, counted, spec.shard_size, len(shards))
    for e in store.errors():
        failures[e["row"] // spec.shard_size].append(SampleFailure(e["row"], e["sample_id"], e["reason"], e["kind"]))

    finished = [done[n][0] + len(failures[n]) == stop - start for n, (start, stop) in enumerate(shards)]
    state = "running" if not all(finished) else ("done" if store.manifest.complete else "finalizing")
    if replace:
        delete_job(redis, keys, job_id)
    pipe = redis.pipeline(transaction=True)
    pipe.hset(
        keys.job(job_id),
        mapping={
            "state": state,
            "spec": spec.model_dump_json(),
            "out": str(spec.out),
            "num_rows": store.manifest.dataset_rows,
            "num_shards": len(shards),
            "finalize_token": "",
            "error": "",
        },
    )
    pipe.zadd(keys.jobs, {job_id: server_time_ms(redis)})
    for n, (start, stop) in enumerate(shards):
        shard = shard_fields(start, stop) | {"done": done[n][0], "tokens": done[n][1], "failed": len(failures[n])}
        if rows := generated[n]:  # as ShardAttempt.row_generated leaves them: row -> "tokens cut", and their sums
            pipe.hset(keys.generation(job_id, n), mapping={row: f"{t} {c}" for row, (t, c) in rows.items()})
            shard |= {"generated_rows": len(rows), "generated": sum(t for t, _ in rows.values()),
                      "cut": sum(c for _, c in rows.values())}  # fmt: skip
        pipe.hset(keys.shard(job_id, n), mapping=shard | {"state": "done" if finished[n] else "pending"})
        if failures[n]:
            pipe.hset(keys.errors(job_id, n), mapping={f.row: json.dumps(asdict(f)) for f in failures[n]})
    if not all(finished):
        pipe.sadd(keys.open(job_id), *(n for n, ok in enumerate(finished) if not ok))
    if state != "done":  # a done job's verdict, if it had one, is in the store's reports/ (`layertap audit` redoes it)
        request_audit(pipe, keys, job_id, spec)
    pipe.execute()
    return Rebuilt(
        job_id=job_id,
        state=state,
        shards_done=sum(finished),
        num_shards=len(shards),
        samples_done=sum(d[0] for d in done),
        samples_failed=sum(len(f) for f in failures),
    )


def _generation(
    store: OutputStore, counted: dict[str, SampleRecord], shard_size: int, num_shards: int
) -> list[dict[int, tuple[int, int]]]:
    """Per shard: row -> (new tokens, turns cut at max_new_tokens) of each counted sample's regenerated row."""
    generated: list[dict[int, tuple[int, int]]] = [{} for _ in range(num_shards)]
    for sample_id, line in store.regenerated_lines(counted).items():
        row = counted[sample_id].index
        cut = sum(m.get("finish_reason") == "length" for m in line["row"]["messages"])
        generated[row // shard_size][row] = (line.get("generated_tokens", 0), cut)
    return generated
