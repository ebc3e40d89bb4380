"""Sending shard messages (a Celery client, by task name: the coordinator never imports the worker)
and the watchdog that requeues shards whose worker or message is gone."""

from __future__ import annotations

import asyncio
import logging

from celery import Celery
from redis import Redis
from redis.exceptions import RedisError

from coordinator.config import CoordinatorSettings
from layertap.state.jobs import reap
from layertap.state.keys import SHARD_QUEUE, Keys

log = logging.getLogger(__name__)


class Dispatcher:
    """Puts task messages on the shard queue of the broker (a Redis: the queue is a list named after it)."""

    def __init__(self, broker_url: str) -> None:
        self.celery = Celery("layertap-coordinator", broker=broker_url)
        self.celery.conf.update(task_serializer="json", broker_connection_retry_on_startup=True)
        self.broker = Redis.from_url(broker_url)

    def send(self, task: str, args: list) -> None:
        self.celery.send_task(task, args=args, queue=SHARD_QUEUE)

    def queue_length(self) -> int:
        """Messages waiting in the shard queue (not those a worker has taken)."""
        return self.broker.llen(SHARD_QUEUE)

    def close(self) -> None:
        self.celery.close()
        self.broker.close()


def reap_once(redis: Redis, keys: Keys, dispatcher: Dispatcher, settings: CoordinatorSettings) -> None:
    """One watchdog pass (blocking; run it in a thread)."""
    reap(
        redis,
        keys,
        dispatcher.send,
        queue_len=dispatcher.queue_length(),
        queued_grace_ms=settings.queued_grace_ms,
        lease_ms=settings.queued_grace_ms,
    )


async def reaper_loop(redis: Redis, keys: Keys, dispatcher: Dispatcher, settings: CoordinatorSettings) -> None:
    """Run the watchdog every ``reaper_interval_s`` until cancelled; Redis outages are waited out."""
    while True:
        try:
            await asyncio.to_thread(reap_once, redis, keys, dispatcher, settings)
        except RedisError as exc:
            log.warning("reaper: Redis unavailable (%s); retrying in %.1fs", exc, settings.reaper_interval_s)
        except Exception:
            log.exception("reaper pass failed")
        await asyncio.sleep(settings.reaper_interval_s)
