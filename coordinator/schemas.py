"""What the API takes and returns, one schema per direction."""

from __future__ import annotations

from dataclasses import asdict

from pydantic import BaseModel, ConfigDict

from layertap.state.model import JobRequest, JobView, StreamState, StreamView


class JobCreate(JobRequest):
    """Body of ``POST /jobs``: an extraction spec plus how to spread it over workers.

    ``model`` and ``data`` are absolute paths every worker can read, under the coordinator's model and data
    roots when it has them (403 otherwise); ``out`` is relative to the coordinator's output root (default: the
    job id). Layer ids are read in ``layer_convention``.
    With ``expected_tokens``, the job is refused (507) unless its estimated output fits on the volume.
    With ``audit_samples``, a worker audits that many stored samples once the job has ended (``JobPublic.audit``).
    """

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "model": "/models/Kimi-K2.5",
                    "data": "/data/sharegpt.jsonl",
                    "layers": [3, 31, 59],
                    "layer_convention": "capture",
                    "format": "specforge",
                    "max_length": 8192,
                    "overlong": "truncate",
                    "out": "kimi-eagle3",
                    "shard_size": 100,
                    "engine": {"in_flight": 8},
                    "expected_tokens": 88_000_000,
                    "audit_samples": 64,
                }
            ]
        }
    )


class WorkerPublic(BaseModel):
    name: str
    samples: int
    tokens: int
    alive: bool
    shard: int | None
    samples_per_s: float
    tokens_per_s: float
    generated_tokens_per_s: float


class GenerationPublic(BaseModel):
    """A regenerating job's generation (the latest regeneration of each row): rows regenerated, their new tokens,
    turns cut at max_new_tokens (kept, ``finish_reason: length``), the live rate, and the seconds until every row is
    regenerated (None while that cannot be told). The job's ``eta_s`` is the later of this and its capture's."""

    rows: int
    tokens: int
    cut_turns: int
    tokens_per_s: float
    eta_s: float | None

    @classmethod
    def of(cls, view: JobView) -> GenerationPublic | None:
        """None for a job that does not regenerate."""
        if not view.regenerates:
            return None
        return cls(
            rows=view.generated_rows,
            tokens=view.generated_tokens,
            cut_turns=view.cut_turns,
            tokens_per_s=view.generated_tokens_per_s,
            eta_s=view.generation_eta_s,
        )


class AuditPublic(BaseModel):
    """The job's audit of its own store: pending, running, pass, fail, inconclusive (the comparison cannot tell: see
    its report), or error (it could not run: see summary).
    A FAIL does not change the job's state: its files are complete; the states in them are not the model's.
    Once running: the device it runs on and how far its reference is, ``layers_done`` of ``layers_total`` decoder
    layers run over every audited sample (the samples finish together, at the last layer)."""

    state: str
    samples: int
    tokens: int
    seconds: float
    report: str | None
    summary: str | None
    device: str | None
    layers_done: int | None
    layers_total: int | None


class JobPublic(BaseModel):
    """A job's progress: samples and tokens done/failed/total, live rate, ETA, per-worker; its generation, if it
    regenerates; its audit, if asked; what it has stored (tokens done x its store's bytes per token, in its store
    dtype: fp8 keeps about half of bf16's)."""

    job_id: str
    state: str
    out: str
    created_ms: int
    finished_ms: int | None
    samples_total: int
    samples_done: int
    samples_failed: int
    tokens_done: int
    tokens_total_estimate: int | None
    store_dtype: str
    bytes_per_token: int | None
    bytes_done_estimate: int | None
    samples_per_s: float
    tokens_per_s: float
    eta_s: float | None
    num_shards: int
    shards: dict[str, int]
    workers: list[WorkerPublic]
    error: str | None
    generation: GenerationPublic | None
    audit: AuditPublic | None

    @classmethod
    def of(cls, view: JobView) -> JobPublic:
        estimate = None
        if view.samples_done:
            estimate = round(view.tokens_done / view.samples_done * (view.num_rows - view.samples_failed))
        return cls(
            job_id=view.job_id,
            state=view.state,
            out=view.out,
            created_ms=view.created_ms,
            finished_ms=view.finished_ms,
            samples_total=view.num_rows,
            samples_done=view.samples_done,
            samples_failed=view.samples_failed,
            tokens_done=view.tokens_done,
            tokens_total_estimate=estimate,
            store_dtype=view.store_dtype,
            bytes_per_token=view.bytes_per_token or None,
            bytes_done_estimate=view.tokens_done * view.bytes_per_token if view.bytes_per_token else None,
            samples_per_s=view.samples_per_s,
            tokens_per_s=view.tokens_per_s,
            eta_s=view.eta_s,
            num_shards=view.num_shards,
            shards=view.shards,
            workers=[WorkerPublic(**asdict(w)) for w in view.workers],
            error=view.error,
            generation=GenerationPublic.of(view),
            audit=AuditPublic(**asdict(view.audit)) if view.audit else None,
        )


class JobsPublic(BaseModel):
    count: int
    jobs: list[JobPublic]


class SampleErrorPublic(BaseModel):
    row: int
    sample_id: str | None
    kind: str
    reason: str


class JobErrorsPublic(BaseModel):
    """Rows that produced no sample: bad rows, rows skipped as too long, captures that failed every attempt."""

    job_id: str
    count: int
    errors: list[SampleErrorPublic]


class WorkerStatePublic(BaseModel):
    """A live worker: ``state`` is idle, working, paused or broken (``reason`` says why it paused, or why its server
    cannot start: it takes no more shards until restarted)."""

    name: str
    state: str
    reason: str | None
    job: str | None
    shard: int | None
    samples_per_s: float
    tokens_per_s: float
    generated_tokens_per_s: float
    free_bytes: int | None
    host: str | None
    engine: str | None

    @classmethod
    def of(cls, name: str, record: dict[str, str]) -> WorkerStatePublic:
        def text(field: str) -> str | None:
            return record.get(field) or None

        def number(field: str) -> int | None:
            return int(record[field]) if record.get(field, "") != "" else None

        return cls(
            name=name,
            state=record.get("state") or "idle",
            reason=text("reason"),
            job=text("job"),
            shard=number("shard"),
            samples_per_s=float(record.get("samples_per_s") or 0),
            tokens_per_s=float(record.get("tokens_per_s") or 0),
            generated_tokens_per_s=float(record.get("generated_tokens_per_s") or 0),
            free_bytes=number("free_bytes"),
            host=text("host"),
            engine=text("engine"),
        )


class WorkersPublic(BaseModel):
    count: int
    workers: list[WorkerStatePublic]


class StreamPublic(BaseModel):
    """A stream's producers against its consumers: samples ``put``, ``acked`` (by every consumer group they wait
    for) and ``dead`` (dead-lettered: a consumer could not use them), ``in_flight`` (put, neither yet: each producer
    holds its own at ``bound``; a job's shard attempts are producers each), ``held`` producers waiting at their bound
    now (the consumers are behind), ``held_s`` the seconds they waited there in all; ``state`` putting, held, paused
    (its job cancelled), draining (its last sample put, the producer waits for the rest's acks) or done."""

    name: str
    state: StreamState
    put: int
    acked: int
    in_flight: int
    bound: int
    held: int
    held_s: float
    dead: int

    @classmethod
    def of(cls, view: StreamView) -> StreamPublic:
        return cls(name=view.name, state=view.state, put=view.put, acked=view.acked, in_flight=view.in_flight,
                   bound=view.bound, held=view.held, held_s=view.held_s, dead=view.dead)  # fmt: skip


class StreamsPublic(BaseModel):
    count: int
    streams: list[StreamPublic]
