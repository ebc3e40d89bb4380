"""A job's audit at its end (``JobSpec.audit_samples``): ``layertap.audit.audit_store`` over N of its samples, in
the worker process, at most once per job.

It is a task of its own, sent by the worker that finalized the job, so it never holds up a shard or the finalize.
The HF reference runs on the worker's ``LAYERTAP_DEVICE`` (``auto``: its GPU when it has one, as ``layertap audit``
picks) after the cached engine is closed: the reference needs the memory that engine holds (an SGLang server's GPU,
or the HF model), and the job it served is over; the next shard loads it again. Its device and progress (layers of
the reference run over every audited sample) go beside its state, at most once a second, one round trip each. A FAIL leaves the job ``done``: its files are complete and verified, and whether their states
are the model's is a second question with its own answer, shown beside the state (``layertap status``, the status
page, the ``layertap_job_audit`` metric). ``layertap audit OUT --samples N`` (seed 0) repeats it by hand.

Not covered by the coordinator's watchdog: a worker killed mid-audit leaves it ``running`` until Celery delivers
the message again (``acks_late``: at once under a prefork pool, after the visibility timeout otherwise), and an
audit whose message was never sent (the finalizer died between marking the job done and sending) stays
``pending``; run ``layertap audit`` by hand then.
"""

from __future__ import annotations

import logging
import time

from redis.exceptions import RedisError

from layertap.device import pick_device
from layertap.state.model import AuditView, JobSpec
from layertap.state.shards import AuditAttempt
from worker.runner import WorkerContext

log = logging.getLogger(__name__)

AUDIT_SEED = 0
PROGRESS_EVERY_S = 1.0


class AuditProgress:
    """The audit's ``progress(done, total)``: written to the job's audit at most once per ``every_s`` (the start and
    the end always), so a deep model's audit costs a few round trips a minute whatever its layer count."""

    def __init__(self, attempt: AuditAttempt, device: str, every_s: float = PROGRESS_EVERY_S) -> None:
        self.attempt, self.device, self.every_s = attempt, device, every_s
        self.done: int | None = None
        self.total: int | None = None
        self._written_at = -float("inf")

    def __call__(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        now = time.monotonic()
        if done in (0, total) or now - self._written_at >= self.every_s:
            self._written_at = now
            try:
                self.attempt.progress(self.device, done, total)
            except RedisError as exc:  # a progress line is not worth the audit: the next write may get through
                log.warning("audit progress not written: %s", exc)


def run_job_audit(ctx: WorkerContext, job_id: str) -> str:
    """Audit the job's store unless its verdict is recorded or a live worker is auditing it; returns the verdict
    (``pass``, ``fail``, ``inconclusive``, ``error``) or why it did not run (``done``, ``busy``, ``inactive``, ``missing``)."""
    attempt = AuditAttempt(ctx.redis, ctx.keys, job_id, ctx.name)
    status, spec = attempt.claim(ctx.settings.lease_ms)
    if status != "ok":
        log.info("job %s: audit not run (%s)", job_id, status)
        return status
    assert spec is not None
    with ctx.heartbeat.holding(job_id, None, attempt.token, audit=True), ctx.status.working():
        verdict = _audit(ctx, spec, attempt)
    if not attempt.finish(verdict):
        log.warning("job %s: audit lost to another worker (its lease expired); verdict not recorded", job_id)
        return "lost"
    log.log(logging.INFO if verdict.state == "pass" else logging.WARNING, "job %s: %s", job_id, verdict.summary)
    return verdict.state


def _audit(ctx: WorkerContext, spec: JobSpec, attempt: AuditAttempt) -> AuditView:
    """The verdict of one audit run; ``error`` (why, in the summary, and how far it got) when it could not run."""
    progress: AuditProgress | None = None
    try:
        from layertap.audit import audit_store  # transformers: imported by the processes that audit, when they do

        assert spec.out is not None
        ctx.check_remote_code(spec)
        progress = AuditProgress(attempt, str(pick_device(ctx.settings.device)))
        ctx.engines.close()
        report = audit_store(spec.out, samples=spec.audit_samples, seed=AUDIT_SEED, device=progress.device,
                             trust_remote_code=spec.trust_remote_code, progress=progress)  # fmt: skip
    except Exception as exc:  # no retry: a person decides (the model moved, no memory...), `layertap audit` redoes it
        log.exception("job audit could not run")
        return AuditView(state="error", samples=spec.audit_samples, summary=f"{type(exc).__name__}: {exc}"[:2000],
                         **_where(progress))  # fmt: skip
    return AuditView(
        state=report.verdict,
        samples=len(report.samples),
        tokens=report.tokens,
        seconds=round(report.seconds, 3),
        report=next((f for f in report.files if f.endswith(".md")), None),
        summary=report.summary(),
        **_where(progress),
    )


def _where(progress: AuditProgress | None) -> dict[str, str | int | None]:
    """The device and the last progress the audit reached, kept beside its verdict."""
    if progress is None:
        return {}
    return {"device": progress.device, "layers_done": progress.done, "layers_total": progress.total}
