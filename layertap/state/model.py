"""The job as the user asks for it (``JobSpec``) and the records the state functions return."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from layertap.settings import JOB_STREAM, EngineOptions, StreamOptions, stream_format_problem, target_of
from layertap.spec import ExtractionSpec

JobState = Literal["running", "cancelled", "failed", "finalizing", "done"]
ShardState = Literal["pending", "queued", "running", "done", "failed"]
# the verdicts are layertap.audit.compare.Verdict (not imported: the coordinator runs without torch)
AuditState = Literal["pending", "running", "pass", "fail", "inconclusive", "error"]
JOB_FILE = "job.json"  # written beside the manifest at submit time; `rebuild-state` reads it back


class JobSpec(StreamOptions, ExtractionSpec):
    """An extraction plus how to spread it: output folder, shard size, engine options, retry budget, and where its
    samples are streamed (`StreamOptions`' fields, named as ``extract``'s: ``stream``, ``stream_name``...).

    ``out`` is relative to the coordinator's output root (default: the job id); once planned it is
    stored resolved and absolute. ``model`` and ``data`` must be absolute paths that every worker sees.
    """

    out: Path | None = Field(default=None, description="Output folder, relative to the output root.")
    shard_size: int = Field(default=100, gt=0, le=100_000, description="Dataset rows per shard (one task each).")
    engine: EngineOptions = EngineOptions()
    audit_samples: int = Field(
        default=0,
        ge=0,
        le=100_000,
        description="Audit this many of the stored samples against an HF reference once the job has ended "
        "(`layertap audit`; 0: no audit). The verdict does not change the job's state.",
    )

    @model_validator(mode="after")
    def _stream_layout(self) -> JobSpec:
        if problem := stream_format_problem(self.stream, self.format):
            raise ValueError(problem)
        target_of(self.stream, self.stream_only)
        return self

    def extraction(self) -> ExtractionSpec:
        """The plain extraction spec (what the manifest and the pipeline need)."""
        return ExtractionSpec(**{name: getattr(self, name) for name in ExtractionSpec.model_fields})

    def streaming(self) -> StreamOptions:
        """Where the job streams its samples, as a worker's settings take it (`RunSettings.tuned`)."""
        return StreamOptions(**{name: getattr(self, name) for name in JOB_STREAM})


class JobRequest(JobSpec):
    """What a client asks the coordinator for (``POST /jobs``, ``layertap submit``): a job, and what the
    coordinator checks before planning it."""

    expected_tokens: int | None = Field(
        default=None,
        gt=0,
        le=10**15,  # a thousand times the largest corpora; beyond float range it could not even be estimated
        description="Rough tokens in the dataset: the job is refused unless its output fits on the volume.",
    )


@dataclass(frozen=True, slots=True)
class Claim:
    """A worker's claim on a shard: ``status`` is ``ok`` or why it must not run it."""

    status: Literal["ok", "missing", "stale", "done", "inactive", "busy"]
    spec: JobSpec | None = None
    start: int = 0
    stop: int = 0
    attempts: int = 0  # claims of this shard so far, this one included


@dataclass(frozen=True, slots=True)
class SampleFailure:
    """One row that produced no sample, as ``/jobs/{id}/errors`` lists it."""

    row: int
    sample_id: str | None
    reason: str
    kind: str  # a key of layertap.errors.ROW_KINDS: "row" (bad row), "duplicate_id", "overlong", "capture"...


@dataclass(slots=True)
class WorkerView:
    """One worker's share of a job: totals committed, and its live rate while it heart-beats."""

    name: str
    samples: int = 0
    tokens: int = 0
    alive: bool = False
    shard: int | None = None
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    generated_tokens_per_s: float = 0.0  # regenerating jobs: new tokens its server generated


StreamState = Literal["putting", "held", "paused", "draining", "done"]
HELD_STALE_MS = 5_000  # a producer waiting at its bound says so every second: an older word is a dead producer's


@dataclass(frozen=True, slots=True)
class StreamView:
    """A stream's producers against its consumers (`layertap.stream`): samples ``put``, ``acked`` (by every group
    they wait for: delivered) and ``dead`` (dead-lettered: a consumer could not use them; settled, not delivered), so
    ``in_flight`` (put, neither yet), which each producer holds at ``bound`` (its --stream-unacked; a job's shard
    attempts are producers each); ``held``: producers waiting at their bound now (the consumers are behind),
    ``held_s``: the seconds they waited there in all."""

    name: str
    put: int
    acked: int
    bound: int
    held: int = 0
    held_s: float = 0.0
    ended: bool = False  # its run has put its last sample
    dead: int = 0
    paused: bool = False  # its job is cancelled: consumers wait for its resume

    @property
    def in_flight(self) -> int:
        return self.put - self.acked - self.dead

    @property
    def state(self) -> StreamState:
        """``draining``: its last sample put, the producer waits for the acks of the rest (its segment holds them)."""
        if self.ended:
            return "draining" if self.in_flight else "done"
        return "paused" if self.paused else "held" if self.held else "putting"

    @classmethod
    def of(
        cls, name: str, run: dict[str, str], put: int, acked: int, dead: int, held: dict[str, str], now_ms: int
    ) -> StreamView:
        """From the stream's run hash, the lengths of its ``current``, ``acked`` and ``dead`` hashes (distinct
        samples) and its ``held`` hash (`layertap.state.keys`), whose stale entries (dead producers') are left out."""
        waits = [tuple(map(int, word.split())) for word in held.values()]
        since = [began for began, seen in waits if now_ms - seen < HELD_STALE_MS]
        return cls(name=name, put=put, acked=acked, bound=int(run.get("bound") or 0), held=len(since),
                   held_s=float(run.get("held_s") or 0) + sum(max(now_ms - s, 0) for s in since) / 1000,
                   ended=run.get("ended") == "1", dead=dead, paused=run.get("paused") == "1")  # fmt: skip


@dataclass(frozen=True, slots=True)
class AuditView:
    """A job's audit of its own store: ``pending`` until the job has ended, ``running``, then its verdict (``pass``,
    ``fail``, ``inconclusive``: the comparison cannot tell, see its report) or ``error`` (it could not run,
    ``summary`` says why). ``samples`` is the number asked until the verdict, then the number audited; ``report`` is
    the markdown report under the store's ``reports/``. Once its reference starts: the ``device`` it runs on and its
    progress, ``layers_done`` of ``layers_total`` decoder layers run over every audited sample (layer by layer, so
    samples finish together at the last layer)."""

    state: AuditState
    samples: int
    tokens: int = 0
    seconds: float = 0.0
    report: str | None = None
    summary: str | None = None
    device: str | None = None
    layers_done: int | None = None
    layers_total: int | None = None

    @classmethod
    def of(cls, record: dict[str, str]) -> AuditView | None:
        """From the job's audit hash (None when the job asked for no audit)."""
        if not record:
            return None
        return cls(
            state=record["state"],  # type: ignore[arg-type]
            samples=int(record["samples"]),
            tokens=int(record.get("tokens") or 0),
            seconds=float(record.get("seconds") or 0),
            report=record.get("report") or None,
            summary=record.get("summary") or None,
            device=record.get("device") or None,
            layers_done=int(record["layers_done"]) if record.get("layers_done") else None,
            layers_total=int(record["layers_total"]) if record.get("layers_total") else None,
        )


@dataclass(slots=True)
class JobView:
    """A job's progress, summed over its shards in one read. A job that regenerates its responses (``regenerates``)
    also counts its regenerated rows, their new tokens and their turns cut at max_new_tokens (the latest regeneration
    of each row, `ShardAttempt.row_generated`); a job that does not keeps them at 0."""

    job_id: str
    state: JobState
    out: str
    created_ms: int
    finished_ms: int | None
    num_rows: int
    num_shards: int
    samples_done: int = 0
    samples_failed: int = 0
    tokens_done: int = 0
    shards: dict[str, int] = field(default_factory=dict)  # shard state -> count
    workers: list[WorkerView] = field(default_factory=list)
    error: str | None = None
    audit: AuditView | None = None
    store_dtype: str = "bfloat16"
    bytes_per_token: int = 0  # 0: unknown (a job whose state was rebuilt)
    regenerates: bool = False
    generated_rows: int = 0  # 0 also for a regenerating job whose state was rebuilt (its store holds the text)
    generated_tokens: int = 0
    cut_turns: int = 0

    @property
    def samples_per_s(self) -> float:
        return sum(w.samples_per_s for w in self.workers if w.alive)

    @property
    def tokens_per_s(self) -> float:
        return sum(w.tokens_per_s for w in self.workers if w.alive)

    @property
    def generated_tokens_per_s(self) -> float:
        return sum(w.generated_tokens_per_s for w in self.workers if w.alive)

    @property
    def rows_to_generate(self) -> int:
        """Rows not handled yet, less those regenerated and waiting for their capture (regenerated rows beyond the
        stored samples; a row that failed after its regeneration makes this a slight underestimate)."""
        waiting = max(self.generated_rows - self.samples_done, 0)
        return max(self.num_rows - self.samples_done - self.samples_failed - waiting, 0)

    @property
    def generation_eta_s(self) -> float | None:
        """Seconds until every row is regenerated: rows to generate x the mean new tokens of a regenerated row /
        the live generated tokens per second; None while that cannot be told (nothing generated, or not now)."""
        if not self.regenerates or self.rows_to_generate == 0:
            return 0.0
        rate = self.generated_tokens_per_s
        if not self.generated_rows or rate <= 0:
            return None
        return self.rows_to_generate * self.generated_tokens / self.generated_rows / rate

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the live rates; None when nothing is moving.

        Without regeneration: rows left / samples per second. A regenerating job has two streams on the same
        servers, generation (new tokens) and capture (stored samples), each measured over the same last minute of
        wall time, so each rate already pays for the server time the other takes: the job ends when the slower one
        does, ``max(generation_eta_s, rows left / samples per second)``. A stream with work left and no live rate
        (capture waiting for the first regenerated rows) is left out, which makes the estimate a lower bound."""
        left = self.num_rows - self.samples_done - self.samples_failed
        if left <= 0:
            return 0.0
        rate = self.samples_per_s
        capture = left / rate if rate > 0 else None
        times = [t for t in (capture, self.generation_eta_s) if t is not None]
        return max(times) if times and max(times) > 0 else None
