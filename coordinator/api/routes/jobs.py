"""``/jobs``: submit, list, inspect, errors, cancel, resume. Handlers stay short; the work is in layertap.state."""

from __future__ import annotations

import uuid
from pathlib import Path

from fastapi import APIRouter, Depends, HTTPException, Query, status
from redis import Redis

from coordinator.api.deps import DispatcherDep, KeysDep, RedisDep, SettingsDep, require_token
from coordinator.api.errors import responses
from coordinator.metrics import SUBMISSIONS
from coordinator.schemas import JobCreate, JobErrorsPublic, JobPublic, JobsPublic, SampleErrorPublic
from layertap.diskspace import DiskSpaceError
from layertap.errors import SpecError
from layertap.pipeline.plan import input_limit_of
from layertap.state.jobs import cancel_job, create_job, dispatch_pending, resume_job
from layertap.state.keys import Keys
from layertap.state.model import JobSpec
from layertap.state.plan import plan_job
from layertap.state.shards import input_limit
from layertap.state.views import job_errors, job_view, list_job_ids

router = APIRouter(
    prefix="/jobs", tags=["jobs"], dependencies=[Depends(require_token)], responses=responses(401, 422, 503)
)


def _job(redis: Redis, keys: Keys, job_id: str) -> JobPublic:
    view = job_view(redis, keys, job_id)
    if view is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}")
    return JobPublic.of(view)


def _check_root(name: str, path: Path, root: Path | None) -> None:
    """403 unless ``path`` lies under ``root`` once ``..`` and symlinks are resolved: workers read whatever a job
    names, so the operator's roots bound what a submitter can make them read. Checked before anything is read;
    a relative path is left to ``plan_job`` (422: it must be absolute)."""
    if root is None or not path.is_absolute():
        return
    try:
        resolved = path.resolve()
    except (OSError, ValueError) as exc:  # a name the filesystem refuses (NUL, not UTF-8), a symlink loop
        raise SpecError(f"{name} {str(path)!r} is not a usable path: {exc}") from exc
    if not resolved.is_relative_to(root.resolve()):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"{name} {str(path)!r} resolves to {resolved}, outside this coordinator's {name} root {root} "
            f"(LAYERTAP_{name.upper()}_ROOT)",
        )


@router.post("", status_code=status.HTTP_201_CREATED, responses=responses(400, 403, 409, 507))
def submit_job(
    body: JobCreate, settings: SettingsDep, redis: RedisDep, keys: KeysDep, dispatcher: DispatcherDep
) -> JobPublic:
    """Check the operator's policy, the spec (a max_length above the input limit the workers' servers said they
    take is refused), the dataset and (given expected_tokens) the free space for the job's plan (`plan_job`: its
    layers resolved once), create the output store, cut shards and enqueue one task per shard."""
    job_id = uuid.uuid4().hex[:12]
    spec = JobSpec(**body.model_dump(exclude={"expected_tokens"}))
    if spec.trust_remote_code and not settings.allow_remote_code:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            "this coordinator does not accept trust_remote_code: its operator has not enabled remote code "
            "(LAYERTAP_ALLOW_REMOTE_CODE)",
        )
    _check_root("model", spec.model, settings.model_root)
    _check_root("data", spec.data, settings.data_root)
    input_limit_of(spec.extraction(), input_limit(redis, keys, str(spec.model)))  # 422 above the workers' limit
    try:
        planned = plan_job(spec, output_root=settings.output_root, job_id=job_id,
                           expected_tokens=body.expected_tokens, min_free_bytes=settings.min_free_bytes)  # fmt: skip
    except DiskSpaceError:
        SUBMISSIONS.labels("no_space").inc()
        raise
    create_job(redis, keys, job_id, planned.spec, planned.shards, bytes_per_token=planned.bytes_per_token)
    dispatch_pending(redis, keys, job_id, dispatcher.send)
    SUBMISSIONS.labels("accepted").inc()
    return _job(redis, keys, job_id)


@router.get("")
def list_jobs(redis: RedisDep, keys: KeysDep, limit: int = Query(default=50, ge=1, le=1000)) -> JobsPublic:
    """Jobs, newest first."""
    jobs = [
        JobPublic.of(v) for job_id in list_job_ids(redis, keys, limit=limit) if (v := job_view(redis, keys, job_id))
    ]
    return JobsPublic(count=len(jobs), jobs=jobs)


@router.get("/{job_id}", responses=responses(404))
def get_job(job_id: str, redis: RedisDep, keys: KeysDep) -> JobPublic:
    """State, samples and tokens done/failed/total, rate, ETA and per-worker progress."""
    return _job(redis, keys, job_id)


@router.get("/{job_id}/errors", responses=responses(404))
def get_job_errors(job_id: str, redis: RedisDep, keys: KeysDep) -> JobErrorsPublic:
    """Every row that produced no sample, with the reason (bad row, too long, capture failed N times)."""
    failures = job_errors(redis, keys, job_id)
    if failures is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}")
    errors = [SampleErrorPublic(row=f.row, sample_id=f.sample_id, kind=f.kind, reason=f.reason) for f in failures]
    return JobErrorsPublic(job_id=job_id, count=len(errors), errors=errors)


@router.post("/{job_id}/cancel", responses=responses(404, 409))
def cancel(job_id: str, redis: RedisDep, keys: KeysDep) -> JobPublic:
    """Stop dispatching; queued shards are skipped, running ones stop at their next sample and are released."""
    before = cancel_job(redis, keys, job_id)
    if before == "missing":
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}")
    if before in ("done", "finalizing"):
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is {before}; there is nothing to cancel")
    return _job(redis, keys, job_id)


@router.post("/{job_id}/resume", responses=responses(404, 409))
def resume(job_id: str, settings: SettingsDep, redis: RedisDep, keys: KeysDep, dispatcher: DispatcherDep) -> JobPublic:
    """Dispatch again every shard that is not done (or finalize, if all are); committed samples are kept."""
    outcome = resume_job(redis, keys, job_id, dispatcher.send, lease_ms=settings.queued_grace_ms)
    if outcome == "missing":
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}")
    if outcome == "done":
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is already done")
    return _job(redis, keys, job_id)
