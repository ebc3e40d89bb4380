"""``/workers``: every live worker's state (idle, working, paused and why), current shard and rates."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from coordinator.api.deps import KeysDep, RedisDep, require_token
from coordinator.api.errors import responses
from coordinator.schemas import WorkersPublic, WorkerStatePublic
from layertap.state.views import live_workers

router = APIRouter(
    prefix="/workers", tags=["workers"], dependencies=[Depends(require_token)], responses=responses(401, 503)
)


@router.get("")
def list_workers(redis: RedisDep, keys: KeysDep) -> WorkersPublic:
    """Workers heart-beating now, by name."""
    workers = [WorkerStatePublic.of(name, record) for name, record in live_workers(redis, keys).items()]
    return WorkersPublic(count=len(workers), workers=workers)
