"""Every Redis key layertap uses, and the names the coordinator and the workers must agree on.

The whole schema, under one prefix (default ``layertap``):

    {p}:jobs                          ZSET  job id -> creation time (ms)
    {p}:seq                           STR   counter; each dispatch takes the next value as its token
    {p}:job:{job}                     HASH  state, spec (JSON), out, num_rows, num_shards, created_ms,
                                            finished_ms, finalize_token, error
    {p}:job:{job}:open                SET   shard numbers not done yet
    {p}:job:{job}:failed              SET   shard numbers that gave up (a subset of open)
    {p}:job:{job}:workers             HASH  "<worker>:samples" / "<worker>:tokens" -> committed by that worker
    {p}:job:{job}:shard:{n}           HASH  start, stop, state, token, worker, done, tokens, failed,
                                            attempts (claims), queued_ms, claimed_ms, finished_ms, error;
                                            regenerating jobs: generated_rows, generated (tokens), cut (turns),
                                            the sums of its :generated hash
    {p}:job:{job}:shard:{n}:lease     STR   token of the attempt that holds the shard; expires unless
                                            its worker heart-beats
    {p}:job:{job}:shard:{n}:errors    HASH  row -> JSON {sample_id, reason, kind, attempts}
    {p}:job:{job}:shard:{n}:generated HASH  row -> "tokens cut_turns" of its latest regeneration (a row regenerated
                                            again, by a later attempt, replaces its figures: counted once)
    {p}:job:{job}:finalize:lease      STR   token of the finalizer; expires unless it heart-beats
    {p}:job:{job}:audit               HASH  (jobs with audit_samples) state, samples (asked, then audited),
                                            tokens, seconds, report, summary, device, layers_done,
                                            layers_total (the reference's progress), token, worker,
                                            attempts, started_ms, finished_ms
    {p}:job:{job}:audit:lease         STR   token of the worker running the audit; expires unless it heart-beats
    {p}:workers                       SET   worker names ever seen (pruned when their key is gone)
    {p}:worker:{name}                 HASH  job, shard, rates, host, pid, engine; expires with the heartbeat
    {p}:input_limit:{model}           HASH  worker name -> the longest prompt (tokens) its server for that model
                                            accepts, set when it attaches; a worker counts while its record lives
    {p}:streams                       ZSET  stream name -> when its producer last opened it (ms): the streams view
    {p}:stream:{name}                 STREAM a streamed run's samples (`layertap.stream`), one entry each: sample_id,
                                            manifest (hs-connectors' JSON: handle, version, tensors, metadata);
                                            trainers read it through a consumer group
    {p}:stream:{name}:run             HASH  identity (JSON: the run putting into the stream), fingerprint (every
                                            entry's metadata carries it, the consumer checks it), put (samples put),
                                            ended (1 once the producer has put its last), bound (each producer's
                                            --stream-unacked: a job's shard attempts are producers each), held_s
                                            (seconds producers waited at their bound, ended waits summed), paused
                                            (1 while its job is cancelled: consumers wait; removed at resume)
    {p}:stream:{name}:held            HASH  producer (its handles' nonce) -> "since_ms seen_ms" while it waits at its
                                            bound: when the wait began, when it last said so (every second; an entry
                                            older than `model.HELD_STALE_MS` is a dead producer's); removed after
    {p}:stream:{name}:groups          HASH  consumer group -> when it registered (ms, Redis' clock; with XGROUP
                                            CREATE): a sample waits for the acks of the groups registered at or
                                            before its entry's time (its id's ms), each group getting every sample
    {p}:stream:{name}:acked:{group}   HASH  sample id -> the consumer of ``group`` that acked it (with its XACK)
    {p}:stream:{name}:acked           HASH  sample id -> the consumer whose ack completed its groups' acks (set once,
                                            atomically with that XACK; its object removed after): delivered
    {p}:stream:{name}:dead            HASH  sample id -> JSON {why, group, consumer}: dead-lettered by a consumer
                                            that could not use it (acked out of its group; settled, not delivered)
    {p}:stream:{name}:taken:{group}   HASH  sample id -> the entry ``group`` delivers it under (a resumed run's
                                            entry of a sample another entry holds is dropped)
    {p}:stream:{name}:current         HASH  sample id -> the handle of its latest put: an entry naming another handle
                                            is stale (its producer died; a resumed run put the sample again)

Shard states: ``pending`` (needs a message) -> ``queued`` (a message carries its token) -> ``running``
(a worker holds the lease) -> ``done``; ``failed`` after the task gave up. Job states: ``running``,
``cancelled``, ``failed``, ``finalizing``, ``done``. Audit states: ``pending`` (until the job has ended and a
worker claims it) -> ``running`` -> ``pass``, ``fail`` or ``error`` (it could not run; the summary says why).
"""

from __future__ import annotations

from dataclasses import dataclass

# Celery names shared by the coordinator (which sends by name) and the worker (which registers them);
# the broker list holding waiting shard messages is named after the queue.
SHARD_QUEUE = "layertap.shards"
RUN_SHARD_TASK = "layertap.run_shard"
FINALIZE_TASK = "layertap.finalize_job"
AUDIT_TASK = "layertap.audit_job"


@dataclass(frozen=True, slots=True)
class Keys:
    """Builds every key; one instance per process, from its settings' prefix."""

    prefix: str = "layertap"

    @property
    def jobs(self) -> str:
        return f"{self.prefix}:jobs"

    @property
    def seq(self) -> str:
        return f"{self.prefix}:seq"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    def worker(self, name: str) -> str:
        return f"{self.prefix}:worker:{name}"

    def input_limit(self, model: str) -> str:
        return f"{self.prefix}:input_limit:{model}"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def open(self, job_id: str) -> str:
        return f"{self.job(job_id)}:open"

    def failed(self, job_id: str) -> str:
        return f"{self.job(job_id)}:failed"

    def job_workers(self, job_id: str) -> str:
        return f"{self.job(job_id)}:workers"

    def shard(self, job_id: str, shard: int) -> str:
        return f"{self.job(job_id)}:shard:{shard}"

    def lease(self, job_id: str, shard: int) -> str:
        return f"{self.shard(job_id, shard)}:lease"

    def errors(self, job_id: str, shard: int) -> str:
        return f"{self.shard(job_id, shard)}:errors"

    def generation(self, job_id: str, shard: int) -> str:
        return f"{self.shard(job_id, shard)}:generated"

    def finalize_lease(self, job_id: str) -> str:
        return f"{self.job(job_id)}:finalize:lease"

    def audit(self, job_id: str) -> str:
        return f"{self.job(job_id)}:audit"

    def audit_lease(self, job_id: str) -> str:
        return f"{self.audit(job_id)}:lease"

    @property
    def streams(self) -> str:
        return f"{self.prefix}:streams"

    def stream(self, name: str) -> str:
        return f"{self.prefix}:stream:{name}"

    def stream_run(self, name: str) -> str:
        return f"{self.stream(name)}:run"

    def stream_acked(self, name: str) -> str:
        return f"{self.stream(name)}:acked"

    def stream_current(self, name: str) -> str:
        return f"{self.stream(name)}:current"

    def stream_taken(self, name: str, group: str) -> str:
        return f"{self.stream(name)}:taken:{group}"

    def stream_groups(self, name: str) -> str:
        return f"{self.stream(name)}:groups"

    def stream_group_acked(self, name: str, group: str) -> str:
        return f"{self.stream_acked(name)}:{group}"

    def stream_dead(self, name: str) -> str:
        return f"{self.stream(name)}:dead"

    def stream_held(self, name: str) -> str:
        return f"{self.stream(name)}:held"

    def job_pattern(self, job_id: str) -> str:
        """Matches every key of one job (for deleting it)."""
        return f"{self.job(job_id)}:*"
