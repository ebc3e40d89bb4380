"""Every metric a worker process exports, in one place (served on ``LAYERTAP_METRICS_PORT``).

All carry a ``worker`` label (the process's worker name), so dashboards name workers, not IPs.
``WorkerMetrics`` binds that label once; code elsewhere only calls ``.inc()``/``.observe()``/``.set()``
on its attributes. Rates (tokens/s, samples/s) are ``rate()`` of the counters in PromQL.
"""

from __future__ import annotations

import logging
from typing import Literal

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

from layertap.errors import ROW_KINDS

log = logging.getLogger(__name__)

State = Literal["idle", "working", "paused", "broken"]
STATES: tuple[State, ...] = ("idle", "working", "paused", "broken")
STAGES = ("queue_wait", "send", "prefill", "dump_wait", "validate", "handover", "refill", "commit")
ERROR_KINDS = (*ROW_KINDS, "server", "task")
PAUSE_REASONS = ("low_disk",)
# From a 1 ms commit to an hour in the queue: every stage fits on one scale.
STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)

SAMPLES = Counter(
    "layertap_worker_samples", "Samples this worker finished, by status (committed, or failed for good).",
    ["worker", "status"],
)  # fmt: skip
TOKENS = Counter("layertap_worker_tokens", "Tokens of the samples this worker committed.", ["worker"])
GENERATED = Counter(
    "layertap_worker_generated_tokens",
    "New tokens this worker's server generated for regenerated rows (each regeneration, a redone one included).",
    ["worker"],
)
CUT = Counter(
    "layertap_worker_cut_turns", "Regenerated turns cut at max_new_tokens (finish_reason length).", ["worker"]
)
WRITTEN = Counter("layertap_worker_written_bytes", "Bytes of sample files this worker committed.", ["worker"])
ERRORS = Counter(
    "layertap_worker_errors",
    "Errors by kind: a row's (layertap.errors.ROW_KINDS: row, encoding, duplicate_id, template, tokenizer, "
    "loss_mask, overlong, input_limit, regenerate, generation, capture, internal), server (the engine or its server failed a shard), task (any other).",
    ["worker", "kind"],
)
SHARDS = Counter("layertap_worker_shards", "Shard attempts this worker ended, by outcome.", ["worker", "outcome"])
STAGE = Histogram(
    "layertap_stage_duration_seconds",
    "Time per stage: queue_wait (per shard), prefill, dump_wait, validate and commit (per sample).",
    ["worker", "stage"],
    buckets=STAGE_BUCKETS,
)
STATE = Gauge(
    "layertap_worker_state", "1 for the state the worker is in (idle, working, paused, broken).", ["worker", "state"]
)
PAUSED = Gauge("layertap_worker_paused", "1 while the worker is paused, labelled with why.", ["worker", "reason"])
FREE = Gauge(
    "layertap_worker_output_free_bytes", "Free bytes on the output volume, as this worker sees it.", ["worker"]
)
FLOOR = Gauge("layertap_worker_min_free_bytes", "The free-space floor below which this worker pauses.", ["worker"])
# The capture plugin runs inside the SGLang server, which has no endpoint of ours: each dump's meta.json
# carries its writer's state, and the worker that reads the dump exports it here.
WRITER_WAIT = Counter(
    "layertap_writer_wait_seconds",
    "Seconds the SGLang forward pass waited for the capture plugin's writers (its host-memory cap was "
    "full: the dump disk is slower than prefill), as reported with each dump.",
    ["worker"],
)
WRITER_QUEUED = Gauge(
    "layertap_writer_queued_dumps", "Dumps queued or being written in the server, at the last dump.", ["worker"]
)
WRITER_PINNED = Gauge(
    "layertap_writer_pinned_bytes",
    "Host (pinned) memory held by captured rows in the server, at the last dump.",
    ["worker"],
)
WRITER_PINNED_CAP = Gauge("layertap_writer_pinned_cap_bytes", "The server's cap on that memory.", ["worker"])
WRITER_PINNED_HELD = Gauge(
    "layertap_writer_pinned_held_bytes",
    "Pinned memory torch's allocator holds in the server (in use + cached for reuse), at the last dump; GPU only.",
    ["worker"],
)
WRITER_PHASES = ("write", "copy_wait")
WRITER_BUSY = Counter(
    "layertap_writer_busy_seconds",
    "Seconds the capture plugin's writer threads spent per dump, by phase: write (serialise, write, fsync) "
    "or copy_wait (waiting for the device-to-host copies of its rows).",
    ["worker", "phase"],
)
WRITER_THREADS = Gauge("layertap_writer_threads", "The server's writer threads.", ["worker"])


class WorkerMetrics:
    """This process's children of every metric, bound to its worker name (made once per process)."""

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self.committed = SAMPLES.labels(worker, "committed")
        self.failed = SAMPLES.labels(worker, "failed")
        self.tokens = TOKENS.labels(worker)
        self.generated_tokens = GENERATED.labels(worker)
        self.cut_turns = CUT.labels(worker)
        self.written_bytes = WRITTEN.labels(worker)
        self.errors = {kind: ERRORS.labels(worker, kind) for kind in ERROR_KINDS}
        self.stages = {stage: STAGE.labels(worker, stage) for stage in STAGES}
        self.states = {state: STATE.labels(worker, state) for state in STATES}
        self.paused = {reason: PAUSED.labels(worker, reason) for reason in PAUSE_REASONS}
        self.free_bytes = FREE.labels(worker)
        self.min_free_bytes = FLOOR.labels(worker)
        self.writer_wait = WRITER_WAIT.labels(worker)
        self.writer_queued = WRITER_QUEUED.labels(worker)
        self.writer_pinned = WRITER_PINNED.labels(worker)
        self.writer_pinned_cap = WRITER_PINNED_CAP.labels(worker)
        self.writer_busy = {phase: WRITER_BUSY.labels(worker, phase) for phase in WRITER_PHASES}
        self.writer_threads = WRITER_THREADS.labels(worker)
        self.writer_pinned_held = WRITER_PINNED_HELD.labels(worker)

    def observe_stage(self, stage: str, seconds: float) -> None:
        """The timing callback handed to code that must not import prometheus (the SGLang engine)."""
        STAGE.labels(self.worker, stage).observe(seconds)

    def observe_writer(self, stats: dict[str, float]) -> None:
        """The writer stats a dump carried (`sglang_patch.contract.DumpMeta.writer`): the engine's callback."""
        self.writer_wait.inc(max(0.0, float(stats.get("wait_s", 0.0))))
        self.writer_queued.set(stats.get("queued", 0))
        self.writer_pinned.set(stats.get("pinned_bytes", 0))
        self.writer_pinned_cap.set(stats.get("pinned_cap_bytes", 0))
        self.writer_busy["write"].inc(max(0.0, float(stats.get("write_s", 0.0))))
        self.writer_busy["copy_wait"].inc(max(0.0, float(stats.get("ready_s", 0.0))))
        self.writer_threads.set(stats.get("threads", 0))
        if "pinned_held_bytes" in stats:
            self.writer_pinned_held.set(stats["pinned_held_bytes"])

    def error(self, kind: str) -> Counter:
        """The error counter of ``kind`` (made on first use for a kind not listed in ERROR_KINDS)."""
        return ERRORS.labels(self.worker, kind)

    def shard_ended(self, outcome: str) -> None:
        SHARDS.labels(self.worker, outcome).inc()


def serve(port: int, host: str = "0.0.0.0") -> bool:
    """Serve the default registry on ``host:port`` from a daemon thread; False if the port is taken
    (a second process of the same worker: only the first exports)."""
    try:
        start_http_server(port, addr=host, registry=REGISTRY)
    except OSError as exc:
        log.warning("metrics: cannot listen on %s:%d (%s); this process exports no metrics", host, port, exc)
        return False
    log.info("metrics on http://%s:%d/metrics", host, port)
    return True
