"""The Celery app (``celery -A worker worker`` finds it here): settings read once, reliable delivery.

A shard message is acknowledged only after its task returns (``acks_late``) and goes back to the
queue if the process running it dies (``reject_on_worker_lost``); each process reserves one message
at a time (prefetch 1) and runs one engine (concurrency 1 by default; ``--pool solo`` works too).
"""

from __future__ import annotations

from celery import Celery

from layertap.logs import LOG_FORMAT
from layertap.state.keys import SHARD_QUEUE
from worker.config import WorkerSettings

settings = WorkerSettings()

app = Celery("layertap-worker", broker=settings.broker_url, include=["worker.tasks"])
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    worker_concurrency=1,
    task_default_queue=SHARD_QUEUE,
    worker_log_format=LOG_FORMAT,  # the CLI's and the coordinator's format; the level is celery's --loglevel
    worker_task_log_format=LOG_FORMAT,
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    broker_transport_options={"visibility_timeout": settings.visibility_timeout_s},
    broker_connection_retry_on_startup=True,
    # Keep running through a broker reconnect: state is guarded by tokens, not by the message.
    worker_cancel_long_running_tasks_on_connection_loss=False,
)
