"""Planning a job at submit time: check everything a worker would trip on, create the store, cut shards.

All checks run before anything is enqueued, so a bad spec or an unreadable dataset never leaves
half a job behind. The store (manifest) is created here, once, so every worker writes into the same
consistent folder; ``job.json`` beside it lets ``rebuild-state`` recreate the job if Redis loses it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from layertap.data.scan import save_duplicates
from layertap.diskspace import bytes_per_token, check_budget
from layertap.errors import SpecError, StoreError
from layertap.pipeline.plan import plan_run
from layertap.settings import target_of
from layertap.state.model import JOB_FILE, JobSpec
from layertap.store.atomic import atomic_write_json
from layertap.store.store import OutputStore


@dataclass(frozen=True, slots=True)
class PlannedJob:
    """A job ready to be written to Redis: its resolved spec and its shards' row ranges."""

    job_id: str
    spec: JobSpec
    shards: list[tuple[int, int]]
    bytes_per_token: int = 0  # what the store keeps per token (`diskspace.bytes_per_token`), for the status page


def plan_shards(num_rows: int, shard_size: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` row ranges of at most ``shard_size`` rows covering every row."""
    return [(start, min(start + shard_size, num_rows)) for start in range(0, num_rows, shard_size)]


_NAME_MAX, _PATH_MAX = 255, 4096  # bytes, as Linux filesystems count them


def resolve_out(out: Path | None, output_root: Path, job_id: str) -> Path:
    """The job's output folder: relative to the output root, and never outside it; a name every
    filesystem call accepts (UTF-8, no NUL, parts and whole within Linux's limits)."""
    if out is not None:
        try:
            parts = [part.encode() for part in out.parts]
        except UnicodeEncodeError as exc:
            raise SpecError(f"out {str(out)!r} is not valid UTF-8 text ({exc.reason})") from exc
        if any(b"\0" in part for part in parts):
            raise SpecError(f"out {str(out)!r} holds a NUL character")
        if max(map(len, parts), default=0) > _NAME_MAX or len(str(out).encode()) > _PATH_MAX - 256:
            raise SpecError(
                f"out is too long for a path ({len(str(out))} characters; folder names at most {_NAME_MAX} bytes)"
            )
    root = output_root.resolve()
    path = (root / (out if out is not None else job_id)).resolve()
    if not path.is_relative_to(root) or path == root:
        raise SpecError(f"out {str(out)!r} resolves to {path}, outside the output root {root}")
    return path


def job_of_store(out: Path) -> tuple[str, JobSpec] | None:
    """(job id, spec) recorded in an output folder, if a job created it."""
    path = out / JOB_FILE
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    return doc["job_id"], JobSpec.model_validate(doc["spec"])


def plan_job(
    spec: JobSpec, *, output_root: Path, job_id: str, expected_tokens: int | None = None, min_free_bytes: int = 0
) -> PlannedJob:
    """Validate ``spec`` against the filesystem, create the output store, and cut the dataset into shards.

    Given ``expected_tokens``, the job's output (that many tokens at the plan's bytes per token) must leave
    ``min_free_bytes`` free under ``output_root``: checked on the plan, before the store is created.

    Raises SpecError (bad paths, layers outside the model, out outside the root), DatasetError (the
    dataset cannot be read or has no rows; a repeated id is one row's error, recorded for the shards),
    DiskSpaceError (the expected output does not fit) or StoreError (the folder holds another run or belongs to
    another job).
    """
    for name in ("model", "data"):
        if not getattr(spec, name).is_absolute():
            raise SpecError(f"{name} must be an absolute path that every worker can read, got {getattr(spec, name)}")
    out = resolve_out(spec.out, output_root, job_id)
    if (existing := job_of_store(out)) is not None:
        raise StoreError(
            f"{out} already belongs to job {existing[0]}: resume that job, or rebuild its state "
            "(layertap rebuild-state) if Redis lost it"
        )
    resolved = spec.model_copy(update={"out": out})
    engine = {"name": "distributed", "job_id": job_id, "note": "per-worker engines are in reports/"}
    target = target_of(spec.stream, spec.stream_only)
    plan = plan_run(resolved.extraction(), target=target, engine=engine)  # its workers' servers are not known yet
    assert plan.scan is not None
    per_token = bytes_per_token(plan.capture, plan.folder.hidden_size, spec.store_dtype)
    if expected_tokens is not None and target != "stream":  # a stream-only job writes no states
        check_budget(expected_tokens * per_token, output_root, min_free_bytes=min_free_bytes)
    OutputStore.create_or_resume(out, plan.manifest()).close()
    save_duplicates(out, plan.scan)  # before any shard runs: shards see only their rows, the scan saw every id
    atomic_write_json(out / JOB_FILE, {"job_id": job_id, "spec": json.loads(resolved.model_dump_json())})
    return PlannedJob(job_id=job_id, spec=resolved, shards=plan_shards(plan.dataset_rows, spec.shard_size),
                      bytes_per_token=per_token)  # fmt: skip
