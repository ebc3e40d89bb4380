"""A worker's state changes for one shard attempt, each one round trip.

An attempt is named by its token (given when the shard was dispatched). The order is: ``claim`` ->
``start`` (counters set from what the store already holds) -> ``row_generated`` (regenerating jobs, before the
row's capture) -> ``sample_done`` / ``sample_failed`` after each commit or failure (``sample_retired`` before the
row of a sample it no longer gives) (the file is in place before Redis hears of it) -> ``complete`` (or
``release`` / ``fail``). ``heartbeat`` keeps the lease alive from a side thread meanwhile.
"""

from __future__ import annotations

import json
from dataclasses import asdict

from redis import Redis

from layertap.state import scripts
from layertap.state.keys import Keys
from layertap.state.model import AuditView, Claim, JobSpec, SampleFailure


class ShardAttempt:
    """One worker's attempt at one shard: the keys and token every call needs."""

    def __init__(self, redis: Redis, keys: Keys, job_id: str, shard: int, token: str, worker: str) -> None:
        self.redis = redis
        self.keys = keys
        self.job_id = job_id
        self.shard = shard
        self.token = token
        self.worker = worker

    def claim(self, lease_ms: int) -> Claim:
        """Take the shard if this attempt's token is current and nobody live holds it."""
        k = self.keys
        reply = scripts.CLAIM(
            [k.job(self.job_id), k.shard(self.job_id, self.shard), k.lease(self.job_id, self.shard)],
            [self.token, self.worker, lease_ms],
            client=self.redis,
        )
        if reply[0] != "ok":
            return Claim(status=reply[0])
        spec = JobSpec.model_validate_json(reply[1])
        return Claim(status="ok", spec=spec, start=int(reply[2]), stop=int(reply[3]), attempts=int(reply[4]))

    def start(self, done: int, tokens: int) -> bool:
        """Reset the shard's counters to what the store verifiably holds; forget the last attempt's errors."""
        k = self.keys
        return bool(
            scripts.START(
                [k.shard(self.job_id, self.shard), k.errors(self.job_id, self.shard)],
                [self.token, done, tokens],
                client=self.redis,
            )
        )

    def sample_done(self, tokens: int) -> str:
        """Count one committed sample; returns the job state, or ``lost`` if the shard moved on."""
        k = self.keys
        return scripts.SAMPLE_DONE(
            [k.job(self.job_id), k.shard(self.job_id, self.shard), k.job_workers(self.job_id)],
            [self.token, tokens, self.worker],
            client=self.redis,
        )

    def sample_retired(self, tokens: int) -> str:
        """Uncount one sample that ``start`` counted done and its row no longer gives (it is about to be done again,
        or fail); returns the job state, or ``lost``."""
        k = self.keys
        return scripts.SAMPLE_RETIRED(
            [k.job(self.job_id), k.shard(self.job_id, self.shard)], [self.token, tokens], client=self.redis
        )

    def row_generated(self, row: int, tokens: int, cut_turns: int) -> str:
        """Count row ``row``'s regeneration (``tokens`` new tokens, ``cut_turns`` turns cut at max_new_tokens) once:
        a row told again replaces its earlier figures. Returns the job state, or ``lost`` if the shard moved on."""
        k = self.keys
        return scripts.ROW_GENERATED(
            [k.job(self.job_id), k.shard(self.job_id, self.shard), k.generation(self.job_id, self.shard)],
            [self.token, row, tokens, cut_turns],
            client=self.redis,
        )

    def sample_failed(self, failure: SampleFailure) -> str:
        """Record a row that produced no sample; returns the job state, or ``lost``."""
        k = self.keys
        return scripts.SAMPLE_FAILED(
            [k.job(self.job_id), k.shard(self.job_id, self.shard), k.errors(self.job_id, self.shard)],
            [self.token, failure.row, json.dumps(asdict(failure))],
            client=self.redis,
        )

    def is_current(self) -> bool:
        """Whether the job still runs and the shard is still this attempt's (a wait that commits nothing asks: a
        streamed shard's wait for its acks)."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hget(self.keys.job(self.job_id), "state")
            pipe.hmget(self.keys.shard(self.job_id, self.shard), "token", "state")
            job, shard = pipe.execute()
        return job == "running" and shard == [self.token, "running"]

    def complete(self, *, done: int, tokens: int, failed: int, lease_ms: int) -> str:
        """Mark the shard done with its exact counts: ``finalize`` (this was the last one), ``done`` or ``lost``."""
        k, j = self.keys, self.job_id
        return scripts.COMPLETE(
            [k.job(j), k.shard(j, self.shard), k.lease(j, self.shard), k.open(j), k.failed(j), k.finalize_lease(j)],
            [self.token, done, tokens, failed, lease_ms, self.shard],
            client=self.redis,
        )

    def release(self, *, retry_in_s: float | None = None) -> bool:
        """Give the shard back: to ``pending`` (dispatched again later), or with ``retry_in_s`` to
        ``queued`` under the same token, because a Celery retry of this message is due then."""
        k = self.keys
        mode = "pending" if retry_in_s is None else "queued"
        return bool(
            scripts.RELEASE(
                [k.shard(self.job_id, self.shard), k.lease(self.job_id, self.shard)],
                [self.token, mode, int((retry_in_s or 0) * 1000)],
                client=self.redis,
            )
        )

    def fail(self, error: str) -> str:
        """Give up on the shard (retries exhausted, or an error no retry fixes)."""
        k, j = self.keys, self.job_id
        return scripts.FAIL(
            [k.job(j), k.shard(j, self.shard), k.lease(j, self.shard), k.open(j), k.failed(j)],
            [self.token, error[:2000], self.shard],
            client=self.redis,
        )


class FinalizeAttempt:
    """The one process allowed to finalize a job's store, named by its finalize token."""

    def __init__(self, redis: Redis, keys: Keys, job_id: str, token: str) -> None:
        self.redis = redis
        self.keys = keys
        self.job_id = job_id
        self.token = token

    def claim(self, lease_ms: int) -> JobSpec | None:
        reply = scripts.CLAIM_FINALIZE(
            [self.keys.job(self.job_id), self.keys.finalize_lease(self.job_id)],
            [self.token, lease_ms],
            client=self.redis,
        )
        return None if reply is None else JobSpec.model_validate_json(reply)

    def note_error(self, error: str) -> None:
        """Say on the job why finalizing failed (its lease then expires and the watchdog tries again)."""
        self.redis.hset(self.keys.job(self.job_id), "error", error[:2000])

    def finish(self, *, error: str | None = None) -> bool:
        """Mark the job done, or with ``error`` failed (its outcome is not what was asked: nothing stored,
        too many bad rows); written after the store's manifest says complete."""
        outcome = ["done", ""] if error is None else ["failed", error[:2000]]
        return bool(
            scripts.FINISH(
                [self.keys.job(self.job_id), self.keys.finalize_lease(self.job_id)],
                [self.token, *outcome],
                client=self.redis,
            )
        )


class AuditAttempt:
    """One worker's run of a job's audit (``JobSpec.audit_samples``): claimed by one live worker at a time, its
    verdict written once, by the claim that still holds it."""

    def __init__(self, redis: Redis, keys: Keys, job_id: str, worker: str) -> None:
        self.redis = redis
        self.keys = keys
        self.job_id = job_id
        self.worker = worker
        self.token = ""

    def claim(self, lease_ms: int) -> tuple[str, JobSpec | None]:
        """(``ok``, the job's spec), or why not to run it: ``done`` (verdict recorded), ``busy`` (a live worker runs
        it), ``inactive`` (the job has not ended), ``missing`` (no such job, or it asked for no audit)."""
        k, j = self.keys, self.job_id
        reply = scripts.CLAIM_AUDIT(
            [k.job(j), k.audit(j), k.audit_lease(j), k.seq], [self.worker, lease_ms], client=self.redis
        )
        if reply[0] != "ok":
            return reply[0], None
        self.token = reply[1]
        return "ok", JobSpec.model_validate_json(reply[2])

    def progress(self, device: str, done: int, total: int) -> bool:
        """Say where the audit runs and how far its reference is (decoder layers run over every audited sample), in
        one round trip; False if this claim no longer holds the audit."""
        return bool(
            scripts.AUDIT_PROGRESS([self.keys.audit(self.job_id)], [self.token, device, done, total], client=self.redis)
        )

    def finish(self, verdict: AuditView) -> bool:
        """Record the verdict; False if this claim lost the audit to another worker meanwhile."""
        fields = [item for pair in asdict(verdict).items() for item in pair]
        return bool(
            scripts.FINISH_AUDIT(
                [self.keys.audit(self.job_id), self.keys.audit_lease(self.job_id)],
                [self.token, *("" if v is None else v for v in fields)],
                client=self.redis,
            )
        )


def renew_lease(
    redis: Redis, keys: Keys, job_id: str, shard: int | None, token: str, lease_ms: int, *, audit: bool = False
) -> bool:
    """Heartbeat: renew a shard lease (``shard`` given), the job's audit lease (``audit``) or its finalize lease;
    False if no longer ours."""
    if audit:
        hash_key, lease, state, field = keys.audit(job_id), keys.audit_lease(job_id), "running", "token"
    elif shard is None:
        hash_key, lease, state, field = keys.job(job_id), keys.finalize_lease(job_id), "finalizing", "finalize_token"
    else:
        hash_key, lease, state, field = keys.shard(job_id, shard), keys.lease(job_id, shard), "running", "token"
    return bool(scripts.HEARTBEAT([hash_key, lease], [token, lease_ms, state, field], client=redis))


def publish_worker(redis: Redis, keys: Keys, name: str, info: dict[str, str | int | float], ttl_ms: int) -> None:
    """A worker's live record (what it runs, its rates); it vanishes ``ttl_ms`` after the last heartbeat."""
    pipe = redis.pipeline(transaction=False)
    pipe.delete(keys.worker(name))
    pipe.hset(keys.worker(name), mapping=info)
    pipe.pexpire(keys.worker(name), ttl_ms)
    pipe.sadd(keys.workers, name)
    pipe.execute()


def publish_input_limit(redis: Redis, keys: Keys, model: str, worker: str, limit: int | None) -> None:
    """Say that ``worker``'s server for ``model`` accepts prompts of at most ``limit`` tokens (None: no limit known),
    so that the coordinator refuses a job asking more (`input_limit`)."""
    if limit is None:
        redis.hdel(keys.input_limit(model), worker)
    else:
        redis.hset(keys.input_limit(model), worker, limit)


def input_limit(redis: Redis, keys: Keys, model: str) -> int | None:
    """The lowest limit the live workers said their servers for ``model`` accept (any of them may run a job's
    shard); None while none has said (a worker whose record expired with its heartbeat no longer counts)."""
    limits = redis.hgetall(keys.input_limit(model))
    if not limits:
        return None
    pipe = redis.pipeline(transaction=False)
    for worker in limits:
        pipe.exists(keys.worker(worker))
    live = [int(limit) for (worker, limit), alive in zip(limits.items(), pipe.execute(), strict=True) if alive]
    return min(live, default=None)
