"""Timing around core calls, so the core never imports prometheus: a store whose commits are timed and
counted, and how long a shard waited in the queue."""

from __future__ import annotations

import time
from pathlib import Path

from redis import Redis

from layertap.sample import CapturedSample
from layertap.state.keys import Keys
from layertap.store.index import SampleRecord
from layertap.store.store import OutputStore
from worker.metrics import WorkerMetrics


class MeteredStore(OutputStore):
    """An ``OutputStore`` that observes each commit's duration (validate + write + fsync + rename +
    index append) and counts the bytes it wrote."""

    metrics: WorkerMetrics

    @classmethod
    def open_metered(cls, root: Path, metrics: WorkerMetrics) -> MeteredStore:
        store = cls.open_existing(root)
        store.metrics = metrics
        return store

    def commit(self, captured: CapturedSample) -> SampleRecord:
        t0 = time.perf_counter()
        record = super().commit(captured)
        self.metrics.stages["commit"].observe(time.perf_counter() - t0)
        self.metrics.written_bytes.inc(record.nbytes)
        return record


def queue_wait_s(redis: Redis, keys: Keys, job_id: str, shard: int) -> float | None:
    """Seconds between the shard's message being due (dispatched, or a retry's delay over) and its
    claim, both on the Redis clock; None if the shard does not say. Read right after a claim."""
    queued, claimed = redis.hmget(keys.shard(job_id, shard), "queued_ms", "claimed_ms")
    if not queued or not claimed:
        return None
    return max(0.0, (int(claimed) - int(queued)) / 1000)
