"""A side thread that keeps this process's lease alive and publishes what it is doing.

The lease, not the Celery message, is what says "this shard is being worked on": the coordinator
requeues a running shard whose lease expired. Beating from a thread means a slow prefill never
looks like a dead worker; a killed or frozen process stops beating and loses the shard.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from redis import Redis
from redis.exceptions import RedisError

from layertap.state.keys import Keys
from layertap.state.shards import publish_worker, renew_lease
from worker.config import WorkerSettings

log = logging.getLogger(__name__)


class RateMeter:
    """Samples (or regenerated rows) and their tokens per second over the last ``window_s`` seconds (monotonic
    clock, no skew)."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def add(self, tokens: int) -> None:
        with self._lock:
            self._events.append((time.monotonic(), tokens))

    def rates(self) -> tuple[float, float]:
        """(samples/s, tokens/s)."""
        now = time.monotonic()
        with self._lock:
            while self._events and self._events[0][0] < now - self.window_s:
                self._events.popleft()
            if not self._events:
                return 0.0, 0.0
            span = max(now - self._events[0][0], 1.0)
            return len(self._events) / span, sum(t for _, t in self._events) / span


@dataclass(frozen=True, slots=True)
class Held:
    """What the process holds: a shard attempt, or (``shard`` None) a job's finalization or (``audit``) its audit."""

    job_id: str
    shard: int | None
    token: str
    audit: bool = False


class Heartbeat:
    """Renews the held lease and refreshes the worker record every ``settings.heartbeat_s`` seconds."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        settings: WorkerSettings,
        meter: RateMeter,
        generation: RateMeter,
        name: str,
        extra: Callable[[], dict[str, str | int]] | None = None,
    ) -> None:
        """``meter`` counts committed samples, ``generation`` regenerated rows (their new tokens); ``extra`` adds
        fields to the published record (the worker's state and free space)."""
        self.redis, self.keys, self.settings, self.meter, self.name = redis, keys, settings, meter, name
        self.extra = extra
        self.generation = generation
        self._held: Held | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="layertap-heartbeat", daemon=True)
        self._thread.start()

    @contextmanager
    def holding(self, job_id: str, shard: int | None, token: str, *, audit: bool = False) -> Iterator[None]:
        self._held = Held(job_id, shard, token, audit)
        try:
            yield
        finally:
            self._held = None

    def beat(self) -> None:
        """One heartbeat (two round trips): renew the lease if something is held, publish the record."""
        held = self._held
        if held is not None and not renew_lease(
            self.redis, self.keys, held.job_id, held.shard, held.token, self.settings.lease_ms, audit=held.audit
        ):
            log.warning(
                "job %s shard %s: lease lost (token %s is no longer current)", held.job_id, held.shard, held.token
            )
        samples_per_s, tokens_per_s = self.meter.rates()
        info = {
            "job": held.job_id if held else "",
            "shard": "" if held is None or held.shard is None else held.shard,
            "samples_per_s": round(samples_per_s, 3),
            "tokens_per_s": round(tokens_per_s, 1),
            "generated_tokens_per_s": round(self.generation.rates()[1], 1),
            "engine": self.settings.engine,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            **(self.extra() if self.extra else {}),
        }
        publish_worker(self.redis, self.keys, self.name, info, self.settings.lease_ms)

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_s):
            try:
                self.beat()
            except RedisError as exc:  # Redis restarting: keep trying, the lease outlives a short outage
                log.warning("heartbeat failed: %s", exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
