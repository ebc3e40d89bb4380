"""What a worker process keeps between tasks, and the work behind each task (no Celery here).

``WorkerContext`` is built once per process: the Redis client (retrying through a short Redis
restart), the engine cache, the heartbeat thread. ``run_shard`` claims a shard attempt, runs the
shared `Run` over its rows into the job's target, and completes it; the attempt that completes
the last shard finalizes the store, then sends the job's audit (``worker.audit``) when it asks for one.

Each attempt is a `layertap.pipeline.Run` over the shard's rows: the job's stored plan bound to this worker's engine,
the job's store, and its target. A job that streams (``JobSpec.streaming``, the worker's ``LAYERTAP_STREAM*`` where it
names none) makes each shard attempt a producer of its own (`layertap.stream.sink.MooncakeSink`, its segment in this
process): with files too it first puts again what the shard's rows hold that no consumer acked (stream-only: what no
consumer acked is recomputed), and the shard completes only once every sample it put is acked, so a shard done never
has samples left in a segment that could die; the finalizer ends the stream. The process keeps its Mooncake client
from one attempt to the next while the segment holds nothing of the last (`layertap.stream.sink.KeptClients`).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from redis import Redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from layertap.engines.base import Engine
from layertap.errors import ServerConfigError, ServerError
from layertap.pipeline import Committed, FailureTally, Run, RunPlan, plan_run, run_verdict, target_for
from layertap.state.jobs import Send
from layertap.state.keys import AUDIT_TASK, Keys
from layertap.state.model import JobSpec, SampleFailure
from layertap.state.shards import FinalizeAttempt, ShardAttempt, publish_input_limit
from layertap.state.views import job_errors
from layertap.store.guide import target_folder
from layertap.store.index import SampleRecord
from layertap.store.manifest import read_manifest
from layertap.store.store import OutputStore
from worker.config import WorkerSettings
from worker.engines import EngineCache
from worker.guard import DiskGuard, WorkerStatus
from worker.heartbeat import Heartbeat, RateMeter
from worker.instrument import queue_wait_s
from worker.metrics import WorkerMetrics, serve

if TYPE_CHECKING:
    from layertap.stream.sink import KeptClients, MooncakeSink

log = logging.getLogger(__name__)


def connect_redis(url: str, *, patience_s: float = 60.0) -> Redis:
    """A client whose commands retry with backoff for about ``patience_s`` while Redis is unreachable."""
    retries = max(1, int(patience_s / 2))
    return Redis.from_url(
        url,
        decode_responses=True,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.1), retries),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        socket_connect_timeout=5,
    )


class RedisEvents:
    """``ShardEvents`` that count each outcome in Redis (one round trip) and in the metrics, stop once the job or
    shard moves on, and wait while the output volume is below the free-space floor."""

    def __init__(
        self,
        attempt: ShardAttempt,
        meter: RateMeter,
        generation: RateMeter,
        metrics: WorkerMetrics,
        guard: DiskGuard,
        out: Path,
    ) -> None:
        """``meter`` counts committed samples, ``generation`` regenerated rows (the heartbeat publishes both rates)."""
        self.attempt = attempt
        self.meter = meter
        self.generation = generation
        self.metrics = metrics
        self.guard = guard
        self.out = out
        self.already_tokens = 0
        self.job_state = "running"

    def start(self, total: int, already_done: int, already_tokens: int) -> None:
        self.already_tokens = already_tokens
        if not self.attempt.start(already_done, already_tokens):
            self.job_state = "lost"

    def committed(self, done: Committed) -> None:
        tokens = done.sample.num_tokens
        self.metrics.stages["commit"].observe(done.seconds)
        if done.record.sha256:  # a file written (a stream-only sample's bytes went to Mooncake, not the volume)
            self.metrics.written_bytes.inc(done.record.nbytes)
        self.meter.add(tokens)
        self.metrics.committed.inc()
        self.metrics.tokens.inc(tokens)
        self.job_state = self.attempt.sample_done(tokens)

    def generated(self, *, row: int, tokens: int, cut_turns: int) -> None:
        self.generation.add(tokens)
        self.metrics.generated_tokens.inc(tokens)
        self.metrics.cut_turns.inc(cut_turns)
        self.job_state = self.attempt.row_generated(row, tokens, cut_turns)

    def retired(self, record: SampleRecord) -> None:
        self.already_tokens -= record.num_tokens
        self.job_state = self.attempt.sample_retired(record.num_tokens)

    def failed(self, *, row: int, sample_id: str | None, reason: str, kind: str) -> None:
        self.metrics.failed.inc()
        self.metrics.error(kind).inc()
        self.job_state = self.attempt.sample_failed(SampleFailure(row, sample_id, reason, kind))

    def keep_going(self) -> bool:
        if self.job_state != "running":
            return False
        if not self.guard.wait_for_space(self.out, self._job_running):
            self.job_state = "cancelled"
        return self.job_state == "running"

    def _job_running(self) -> bool:
        a = self.attempt
        return a.redis.hget(a.keys.job(a.job_id), "state") == "running"


class WorkerContext:
    """Per-process resources and the two kinds of work: run a shard, finalize a job. ``send(task_name, args)``
    puts a message on the queue (a job's audit, sent by its finalizer)."""

    def __init__(self, settings: WorkerSettings, send: Send) -> None:
        self.settings = settings
        self.send = send
        self.pid = os.getpid()
        self.name = settings.process_name()
        self.redis = connect_redis(settings.redis_url)
        self.keys = Keys(settings.key_prefix)
        self.engines = EngineCache(settings)
        self.producers: KeptClients | None = None  # the streams' Mooncake clients kept between attempts (at the first)
        self.meter = RateMeter()
        self.generation = RateMeter()
        self.metrics = WorkerMetrics(self.name)
        self.status = WorkerStatus(self.metrics)
        self.guard = DiskGuard(
            self.status,
            min_free_bytes=settings.min_free_bytes,
            resume_free_bytes=settings.resume_free_bytes or settings.min_free_bytes,
            check_s=settings.disk_check_s,
        )
        self.heartbeat = Heartbeat(
            self.redis, self.keys, settings, self.meter, self.generation, self.name, extra=self.status.record
        )
        self.status.on_change = self.heartbeat.beat  # a pause shows in Redis at once, not at the next beat
        if settings.metrics_port:
            serve(settings.metrics_port, settings.metrics_host)

    def attempt(self, job_id: str, shard: int, token: str) -> ShardAttempt:
        return ShardAttempt(self.redis, self.keys, job_id, shard, token, self.name)

    def run_shard(self, job_id: str, shard: int, token: str) -> str:
        """Run one shard attempt; returns what happened (``done``, ``finalized``, ``released``, or why skipped)."""
        t0 = time.monotonic()
        plan = self.prepare_engine(job_id)
        attempt = self.attempt(job_id, shard, token)
        claim = attempt.claim(self.settings.lease_ms)
        if claim.status != "ok":
            log.info("job %s shard %d token %s: not run (%s)", job_id, shard, token, claim.status)
            return claim.status
        if claim.attempts > self.settings.max_shard_attempts:
            attempt.fail(f"claimed {claim.attempts - 1} times before without finishing (its workers died?)")
            return "failed"
        spec = claim.spec
        assert spec is not None and spec.out is not None
        if (waited := queue_wait_s(self.redis, self.keys, job_id, shard)) is not None:
            self.metrics.stages["queue_wait"].observe(waited)
        events = RedisEvents(attempt, self.meter, self.generation, self.metrics, self.guard, spec.out)
        with self.heartbeat.holding(job_id, shard, token), self.status.working():
            store = OutputStore.open_existing(spec.out)
            store.writer_id = f"{self.name}-s{shard}-t{token}"
            sink = None
            try:
                plan = plan or self.plan(spec)  # the attempt's one plan: its engine's, its rows'
                engine = self.engine_for(spec, plan)
                sink = self.stream_sink(spec, attempt)
                run = Run(plan.on(engine), engine, store, target_for(store, sink), self.settings.resume_check,
                          self.settings.commit_threads, plan_processes=self.settings.plan_processes,
                          switch_interval_ms=self.settings.switch_interval_ms)  # fmt: skip
                run.target.open(None, claim.start, claim.stop)
                report = run.rows(claim.start, claim.stop, events)
                if not report.stopped:  # done only once delivered: see the module's docstring
                    report.stopped = not run.target.delivered(last=False)
            except ServerError:
                self.engines.close()  # the next task starts a fresh engine (and server)
                raise
            finally:
                store.close()
                if sink is not None and self.producers is not None:  # what no consumer acked goes with the segment
                    self.producers.give_back(sink)  # (the shard's next attempt puts it); a clean one is kept
            report.seconds = time.monotonic() - t0
            report.save()
        if report.stopped:
            attempt.release()
            log.info(
                "job %s shard %d: stopped (%s) after %d samples", job_id, shard, events.job_state, len(report.computed)
            )
            return "released"
        # The shard's rows that gave no sample, as its live counter has them (`RedisEvents.failed`: every row error,
        # those skipped as too long too); the job's verdict leaves the skipped out, as a run's does (`run_verdict`).
        no_sample = report.row_errors + report.skipped_overlong + report.failed
        outcome = attempt.complete(
            done=report.already_done + len(report.computed),
            tokens=events.already_tokens + report.tokens,
            failed=no_sample,
            lease_ms=self.settings.lease_ms,
        )
        log.info(
            "job %s shard %d [%d, %d): %s; %d computed (%d tokens), %d already done, %d bad rows and failed captures, "
            "%d skipped as too long, in %.1fs",
            job_id, shard, claim.start, claim.stop, outcome, len(report.computed), report.tokens,
            report.already_done, report.row_errors + report.failed, report.skipped_overlong, report.seconds,
        )  # fmt: skip
        if outcome == "finalize":
            return self.finalize(job_id, token)
        return outcome

    def stream_sink(self, spec: JobSpec, attempt: ShardAttempt) -> MooncakeSink | None:
        """The attempt's producer on the job's stream (None when the job does not stream); its waits for acks stop
        once the shard is no longer the attempt's or the job stops. The stream's identity names no server: a job's
        samples come from every worker's (the store's server notes refuse one that computes otherwise)."""
        settings = self.settings.tuned(spec.streaming())
        if settings.stream is None:
            if self.producers is not None:
                self.producers.close()  # a segment kept for streamed jobs is not held through others'
            return None
        from layertap.stream.sink import KeptClients  # the stream extra: only a worker whose jobs stream needs it

        assert spec.out is not None
        self.producers = self.producers or KeptClients()
        segment_dir = self.settings.dump_root if self.settings.engine == "sglang" else None  # its server writes there
        return self.producers.open(settings, spec.out, prefix=self.settings.key_prefix, keep_going=attempt.is_current,
                                   segment_dir=segment_dir)  # fmt: skip

    def end_stream(self, spec: JobSpec) -> None:
        """Tell the job's stream's consumers it has put its last sample (every shard done, each one's acked)."""
        settings = self.settings.tuned(spec.streaming())
        if settings.stream is None:
            return
        from layertap.stream.sink import end_stream, redis_client, stream_name

        assert spec.out is not None
        redis = redis_client(settings.stream_redis_url)
        try:
            end_stream(redis, Keys(self.settings.key_prefix), stream_name(settings, spec.out))
        finally:
            redis.close()

    def prepare_engine(self, job_id: str) -> RunPlan | None:
        """Start (or keep) the engine for a running job before claiming one of its shards: a server that takes
        minutes to start (a restarted worker's, a 1T model's) then holds no shard meanwhile, and the watchdog
        hands the shard, still queued, to a worker that is ready (``LAYERTAP_QUEUED_GRACE_S``). A failure here
        is left to the claimed attempt, which reports it the usual way. Returns the job's plan as made here (None
        when it was not), for the attempt."""
        state, raw = self.redis.hmget(self.keys.job(job_id), "state", "spec")
        if state != "running" or raw is None:
            return None
        plan = None
        try:
            spec = JobSpec.model_validate_json(raw)
            plan = self.plan(spec)
            self.engine_for(spec, plan)
        except ServerConfigError:  # the worker's own fault, whatever the shard: it is out of the job
            raise
        except Exception as exc:  # reported by the attempt that claims the shard
            log.warning("job %s: engine not ready before the claim (%s: %s)", job_id, type(exc).__name__, exc)
        return plan

    def plan(self, spec: JobSpec) -> RunPlan:
        """The job's plan as its store's manifest records it (`plan_run`: the model folder read once, the layers
        resolved once), refused when the job wants model code run that this worker was not allowed to run."""
        self.check_remote_code(spec)
        assert spec.out is not None
        return plan_run(spec.extraction(), stored=read_manifest(spec.out))

    def engine_for(self, spec: JobSpec, plan: RunPlan) -> Engine:
        """This process's engine for ``spec`` (`EngineCache`, from the plan's capture and folder); its server's input
        limit is told to Redis, where the coordinator refuses a job whose max_length is above it."""
        engine = self.engines.get(spec, plan.capture, plan.folder)
        publish_input_limit(self.redis, self.keys, str(spec.model), self.name, engine.input_limit)
        return engine

    def check_remote_code(self, spec: JobSpec) -> None:
        """Refuse a job that wants the model folder's code run when this worker was not allowed to run it."""
        if spec.trust_remote_code and not self.settings.allow_remote_code:
            raise ServerError(
                f"job asks for trust_remote_code ({spec.model}) but this worker does not run model code "
                "(LAYERTAP_ALLOW_REMOTE_CODE is off)"
            )

    def finalize(self, job_id: str, token: str) -> str:
        """Build the format's extra files and mark the manifest complete, then the job done (in that order);
        ``failed`` instead, naming the most frequent causes, when it stored nothing or more rows were bad
        than its ``max_bad_rows`` (what it stored is complete and verified all the same).

        A failure to finalize is recorded on the job and left to the coordinator's watchdog, which sends
        the finalize again once this attempt's lease has expired.
        """
        attempt = FinalizeAttempt(self.redis, self.keys, job_id, token)
        spec = attempt.claim(self.settings.lease_ms)
        if spec is None or spec.out is None:
            log.info("job %s: finalize token %s is not current; skipped", job_id, token)
            return "stale"
        with self.heartbeat.holding(job_id, None, token):
            try:
                store = OutputStore.open_existing(spec.out)
                swept = store.sweep_temp_files()  # every shard is done: temp files are from killed writers
                records = store.finalize(complete=True, target=target_folder(store.manifest))
                self.end_stream(spec)
            except Exception as exc:
                log.exception("job %s: finalize failed", job_id)
                attempt.note_error(f"finalize failed: {type(exc).__name__}: {exc}")
                return "finalize-failed"
        ok, verdict = self._verdict(job_id, spec, len(records), store.manifest.dataset_rows)
        if attempt.finish(error=None if ok else verdict) and spec.audit_samples:
            self.send(AUDIT_TASK, [job_id])  # a task of its own: an audit never holds up this worker's next shard
        log.log(
            logging.INFO if ok and not verdict else logging.WARNING,
            "job %s: finalized, %d samples (%d stale temp files removed)%s",
            job_id, len(records), swept, f"; {'done' if ok else 'failed'}: {verdict}" if verdict else "",
        )  # fmt: skip
        return "finalized"  # the job's state says whether it is done or failed

    def _verdict(self, job_id: str, spec: JobSpec, stored: int, rows: int) -> tuple[bool, str]:
        """`run_verdict` of the whole job, from the failures its shards recorded (rows skipped as too long
        are the user's choice, not bad rows)."""
        bad = FailureTally()
        for failure in job_errors(self.redis, self.keys, job_id) or []:
            if failure.kind != "overlong":
                bad.add(failure.kind, failure.reason)
        return run_verdict(rows=rows, stored=stored, bad=bad, max_bad_rows=spec.max_bad_rows)

    def release(self, job_id: str, shard: int, token: str, retry_in_s: float | None = None) -> None:
        """Give a shard attempt back (`ShardAttempt.release`): to ``pending``, for the coordinator to dispatch to
        another worker, or with ``retry_in_s`` to ``queued`` for this message's Celery retry; a no-op when the token
        is no longer the shard's."""
        self.attempt(job_id, shard, token).release(retry_in_s=retry_in_s)

    def broken(self, error: BaseException) -> None:
        """This worker's server cannot start as configured: say so in its record and metrics (state ``broken``)."""
        self.status.set("broken", str(error).splitlines()[0])
        log.error("this worker's server cannot start as configured; it takes no more shards until restarted: %s", error)

    def give_up(self, job_id: str, shard: int, token: str, error: BaseException) -> None:
        outcome = self.attempt(job_id, shard, token).fail(f"{type(error).__name__}: {error}")
        log.error("job %s shard %d: failed (%s): %s", job_id, shard, outcome, error)

    def close(self) -> None:
        self.heartbeat.close()
        self.engines.close()
        if self.producers is not None:
            self.producers.close()
        self.redis.close()
