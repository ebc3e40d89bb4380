"""Thin Celery tasks: map errors to retry-or-give-up and call ``WorkerContext`` (one per process) or the audit."""

from __future__ import annotations

import os

from celery import Task, signals

from layertap.errors import DatasetError, ServerConfigError, ServerError, SpecError, StoreError
from layertap.state.keys import AUDIT_TASK, FINALIZE_TASK, RUN_SHARD_TASK, SHARD_QUEUE
from worker.audit import run_job_audit
from worker.celery import app, settings
from worker.runner import WorkerContext

# The job or its output folder is wrong: a person has to act, so no retry can help.
_NO_RETRY = (SpecError, DatasetError, StoreError)

_context: WorkerContext | None = None


def context() -> WorkerContext:
    """This process's context, made on first use (after a prefork child was forked, not before)."""
    global _context
    if _context is None or _context.pid != os.getpid():
        _context = WorkerContext(settings, send)
    return _context


def send(task: str, args: list) -> None:
    """Put a message on the queue (the work a task leaves to another: a job's audit)."""
    app.send_task(task, args=args)


@signals.worker_process_init.connect
def _open_context(**_: object) -> None:
    """Heartbeat and metrics from the start (an idle worker shows up as idle), not from the first task."""
    context()


@signals.worker_process_shutdown.connect
@signals.worker_shutdown.connect
def _close_context(**_: object) -> None:
    if _context is not None and _context.pid == os.getpid():
        _context.close()


def retry_delay(retries: int) -> float:
    """Exponential backoff: base, 2x base, 4x base... capped."""
    return min(settings.retry_backoff_s * 2**retries, settings.retry_backoff_max_s)


@app.task(bind=True, name=RUN_SHARD_TASK, max_retries=settings.task_max_retries)
def run_shard(self: Task, job_id: str, shard: int, token: str) -> str:
    """Run one attempt at a shard; server, disk or Redis errors retry with backoff, then fail the shard.
    Every attempt's outcome is counted (``layertap_worker_shards_total``)."""
    ctx = context()
    if ctx.status.state == "broken":  # a message that reached it before it stopped consuming
        ctx.release(job_id, shard, token)
        return "broken"
    try:
        outcome = ctx.run_shard(job_id, shard, token)
    except _NO_RETRY as exc:
        ctx.metrics.error("task").inc()
        ctx.give_up(job_id, shard, token, exc)
        outcome = "failed"
    except ServerConfigError as exc:
        # This worker's server cannot start as configured: every shard would fail here the same way. It stops
        # taking shards (state broken, until restarted) and hands this one back, no attempt of it spent.
        ctx.metrics.error("server").inc()
        ctx.broken(exc)
        app.control.cancel_consumer(SHARD_QUEUE, destination=[self.request.hostname], reply=False)
        ctx.release(job_id, shard, token)
        outcome = "broken"
    except Exception as exc:
        ctx.metrics.error("server" if isinstance(exc, ServerError) else "task").inc()
        if self.request.retries >= self.max_retries:
            ctx.give_up(job_id, shard, token, exc)
            outcome = "failed"
        else:
            delay = retry_delay(self.request.retries)
            ctx.release(job_id, shard, token, retry_in_s=delay)
            ctx.metrics.shard_ended("retried")
            raise self.retry(exc=exc, countdown=delay) from exc
    ctx.metrics.shard_ended(outcome)
    return outcome


@app.task(name=FINALIZE_TASK)
def finalize_job(job_id: str, token: str) -> str:
    """Finalize a job whose shards are all done (sent when the worker that completed the last one died)."""
    return context().finalize(job_id, token)


@app.task(name=AUDIT_TASK)
def audit_job(job_id: str) -> str:
    """Audit a job's store once it has ended (sent by the worker that finalized it); a redelivered message finds the
    verdict recorded, or the audit held by a live worker, and does nothing."""
    return run_job_audit(context(), job_id)
