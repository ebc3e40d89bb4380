"""Every metric the coordinator exports on ``/metrics``, in one place.

Per-job progress and each stream's producer (samples put, acked, in flight, held at its bound) live in Redis
already, so they are read at scrape time by ``StateCollector`` (a fixed number of round trips per job or stream,
whatever its size) instead of being copied into counters.
The coordinator's own events are plain counters bumped where they happen.
"""

from __future__ import annotations

import logging
from collections import Counter as Tally
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis import Redis
from redis.exceptions import RedisError

from coordinator.config import CoordinatorSettings
from coordinator.dispatch import Dispatcher
from layertap.diskspace import free_bytes
from layertap.state.keys import Keys
from layertap.state.model import AuditState, JobState, ShardState
from layertap.state.views import job_view, list_job_ids, live_workers, stream_views

log = logging.getLogger(__name__)

JOB_STATES: tuple[JobState, ...] = ("running", "cancelled", "failed", "finalizing", "done")
SHARD_STATES: tuple[ShardState, ...] = ("pending", "queued", "running", "done", "failed")
AUDIT_STATES: tuple[AuditState, ...] = get_args(AuditState)
WORKER_STATES = ("idle", "working", "paused", "broken")

SUBMISSIONS = Counter(
    "layertap_job_submissions",
    "Jobs submitted, by status: accepted, or no_space (refused: the expected output would not fit).",
    ["status"],
    registry=None,
)


@dataclass
class _Families:
    """One family per exported name (the collector fills them for every job, then yields them)."""

    state: GaugeMetricFamily
    samples: GaugeMetricFamily
    tokens: GaugeMetricFamily
    progress: GaugeMetricFamily
    samples_rate: GaugeMetricFamily
    tokens_rate: GaugeMetricFamily
    generated: GaugeMetricFamily
    generated_rate: GaugeMetricFamily
    cut_turns: GaugeMetricFamily
    eta: GaugeMetricFamily
    shards: GaugeMetricFamily
    audit: GaugeMetricFamily

    @classmethod
    def new(cls) -> _Families:
        g = GaugeMetricFamily
        return cls(
            state=g("layertap_job_state", "1 for the state the job is in.", labels=["job_id", "state"]),
            samples=g(
                "layertap_job_samples",
                "Dataset rows by status: done (committed), failed (recorded as failed), remaining. They sum to the rows.",
                labels=["job_id", "status"],
            ),
            tokens=g(
                "layertap_job_tokens",
                "Tokens by status: done (committed), remaining (estimated from the mean tokens per done sample).",
                labels=["job_id", "status"],
            ),
            progress=g("layertap_job_progress_ratio", "Rows handled (done or failed) / all rows.", labels=["job_id"]),
            samples_rate=g(
                "layertap_job_samples_per_second", "Samples/s over the live workers' last minute.", labels=["job_id"]
            ),
            tokens_rate=g(
                "layertap_job_tokens_per_second", "Tokens/s over the live workers' last minute.", labels=["job_id"]
            ),
            generated=g(
                "layertap_job_generated_tokens",
                "New tokens of the job's regenerated rows, the latest regeneration of each: a level, not a counter (a "
                "row regenerated again may come out shorter); the rate is ..._per_second. Only jobs that regenerate.",
                labels=["job_id"],
            ),
            generated_rate=g(
                "layertap_job_generated_tokens_per_second",
                "Generated tokens/s over the live workers' last minute; only jobs that regenerate.",
                labels=["job_id"],
            ),
            cut_turns=g(
                "layertap_job_cut_turns",
                "Regenerated turns cut at max_new_tokens (kept, finish_reason length); only jobs that regenerate.",
                labels=["job_id"],
            ),
            eta=g(
                "layertap_job_eta_seconds",
                "Seconds left at the recent rates (absent while nothing moves); a regenerating job's is the later of "
                "its generation's and its capture's.",
                labels=["job_id"],
            ),
            shards=g("layertap_job_shards", "Shards by state.", labels=["job_id", "state"]),
            audit=g(
                "layertap_job_audit",
                "1 for the verdict of the job's audit of its own store (pending, running, pass, fail, error: it could "
                "not run); only jobs that asked for one (audit_samples).",
                labels=["job_id", "verdict"],
            ),
        )

    def __iter__(self) -> Iterator[Metric]:
        return iter(getattr(self, f.name) for f in fields(self))


class StateCollector(Collector):
    """Reads jobs, workers and the broker queue at scrape time (the newest ``max_jobs`` jobs)."""

    def __init__(
        self, redis: Redis, keys: Keys, dispatcher: Dispatcher, settings: CoordinatorSettings, *, max_jobs: int = 50
    ) -> None:
        self.redis, self.keys, self.dispatcher, self.settings = redis, keys, dispatcher, settings
        self.max_jobs = max_jobs

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("layertap_redis_up", "1 if the coordinator could read its state from Redis.")
        free = GaugeMetricFamily(
            "layertap_output_free_bytes", "Free bytes on the volume of the coordinator's output root."
        )
        free.add_metric([], free_bytes(self.settings.output_root))
        yield free
        yield GaugeMetricFamily(
            "layertap_output_min_free_bytes",
            "The floor: jobs that would leave less free are refused, and workers pause below it.",
            value=self.settings.min_free_bytes,
        )
        try:
            families, workers, queue = self._read()
            streams = self._streams()
        except RedisError as exc:
            log.warning("metrics: Redis unavailable: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families
        yield from streams
        yield workers
        yield GaugeMetricFamily(
            "layertap_broker_queue_messages", "Shard messages waiting in the broker queue.", value=queue
        )

    def _read(self) -> tuple[_Families, GaugeMetricFamily, int]:
        fam = _Families.new()
        for job_id in list_job_ids(self.redis, self.keys, limit=self.max_jobs):
            view = job_view(self.redis, self.keys, job_id)
            if view is None:  # deleted between the two reads
                continue
            for state in JOB_STATES:
                fam.state.add_metric([job_id, state], 1 if view.state == state else 0)
            handled = view.samples_done + view.samples_failed
            fam.samples.add_metric([job_id, "done"], view.samples_done)
            fam.samples.add_metric([job_id, "failed"], view.samples_failed)
            fam.samples.add_metric([job_id, "remaining"], max(view.num_rows - handled, 0))
            fam.tokens.add_metric([job_id, "done"], view.tokens_done)
            if view.samples_done:
                expected = view.tokens_done / view.samples_done * (view.num_rows - view.samples_failed)
                fam.tokens.add_metric([job_id, "remaining"], max(round(expected) - view.tokens_done, 0))
            fam.progress.add_metric([job_id], handled / view.num_rows if view.num_rows else 1.0)
            fam.samples_rate.add_metric([job_id], view.samples_per_s)
            fam.tokens_rate.add_metric([job_id], view.tokens_per_s)
            if view.regenerates:
                fam.generated.add_metric([job_id], view.generated_tokens)
                fam.generated_rate.add_metric([job_id], view.generated_tokens_per_s)
                fam.cut_turns.add_metric([job_id], view.cut_turns)
            if view.eta_s is not None:
                fam.eta.add_metric([job_id], view.eta_s)
            for state in SHARD_STATES:
                fam.shards.add_metric([job_id, state], view.shards.get(state, 0))
            if view.audit is not None:
                for verdict in AUDIT_STATES:
                    fam.audit.add_metric([job_id, verdict], 1 if view.audit.state == verdict else 0)
        by_state = Tally(w.get("state", "idle") for w in live_workers(self.redis, self.keys).values())
        workers = GaugeMetricFamily("layertap_workers", "Live (heart-beating) workers by state.", labels=["state"])
        for state in WORKER_STATES:
            workers.add_metric([state], by_state.get(state, 0))
        return fam, workers, self.dispatcher.queue_length()

    def _streams(self) -> list[Metric]:
        """Each stream's producer, CLI run or job (`layertap.state.views.stream_views`)."""
        g = GaugeMetricFamily
        samples = g("layertap_stream_samples", "A stream's samples by status: put (distinct), acked by every group, "
                    "dead (dead-lettered: a consumer could not use them), in_flight (put, neither yet: at most the "
                    "bound).", labels=["stream", "status"])  # fmt: skip
        bound = g("layertap_stream_unacked_bound", "A producer's bound: it stops putting at this many in flight.",
                  labels=["stream"])  # fmt: skip
        held = g("layertap_stream_held", "Producers waiting at their bound now: the consumers are behind.",
                 labels=["stream"])  # fmt: skip
        held_s = CounterMetricFamily("layertap_stream_held_seconds", "Seconds producers waited at their bound.",
                                     labels=["stream"])  # fmt: skip
        for view in stream_views(self.redis, self.keys):
            for status, value in (("put", view.put), ("acked", view.acked), ("dead", view.dead),
                                  ("in_flight", view.in_flight)):  # fmt: skip
                samples.add_metric([view.name, status], value)
            bound.add_metric([view.name], view.bound)
            held.add_metric([view.name], view.held)
            held_s.add_metric([view.name], view.held_s)
        return [samples, bound, held, held_s]


def build_registry(state: StateCollector) -> CollectorRegistry:
    """A registry for one app: the process's own collectors, the event counters, and ``state``."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    registry.register(SUBMISSIONS)
    registry.register(state)
    return registry
