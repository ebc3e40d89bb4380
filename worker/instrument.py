"""How long a shard waited in the queue (its commits' timings reach the metrics as run events: `RedisEvents`)."""

from __future__ import annotations

from redis import Redis

from layertap.state.keys import Keys


def queue_wait_s(redis: Redis, keys: Keys, job_id: str, shard: int) -> float | None:
    """Seconds between the shard's message being due (dispatched, or a retry's delay over) and its
    claim, both on the Redis clock; None if the shard does not say. Read right after a claim."""
    queued, claimed = redis.hmget(keys.shard(job_id, shard), "queued_ms", "claimed_ms")
    if not queued or not claimed:
        return None
    return max(0.0, (int(claimed) - int(queued)) / 1000)
