"""What the API takes and returns, one schema per direction."""

from __future__ import annotations

from dataclasses import asdict

from pydantic import BaseModel, ConfigDict

from layertap.state.model import JobSpec, JobView


class JobCreate(JobSpec):
    """Body of ``POST /jobs``: an extraction spec plus how to spread it over workers.

    ``model`` and ``data`` are absolute paths every worker can read; ``out`` is relative to the
    coordinator's output root (default: the job id). Layer ids are read in ``layer_convention``.
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


class JobPublic(BaseModel):
    """A job's progress: samples and tokens done/failed/total, live rate, ETA, per-worker."""

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
    samples_per_s: float
    tokens_per_s: float
    eta_s: float | None
    num_shards: int
    shards: dict[str, int]
    workers: list[WorkerPublic]
    error: str | None

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
            samples_per_s=view.samples_per_s,
            tokens_per_s=view.tokens_per_s,
            eta_s=view.eta_s,
            num_shards=view.num_shards,
            shards=view.shards,
            workers=[WorkerPublic(**asdict(w)) for w in view.workers],
            error=view.error,
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
