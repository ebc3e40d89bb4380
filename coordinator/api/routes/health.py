"""Liveness: open to everyone, even when the API needs a token."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, status
from redis.exceptions import RedisError

from coordinator.api.deps import RedisDep
from coordinator.api.errors import responses

router = APIRouter(tags=["health"])


@router.get("/health", responses=responses(503))
def health(redis: RedisDep) -> dict[str, str]:
    """The coordinator is up and reaches Redis."""
    try:
        redis.ping()
    except RedisError as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"Redis unreachable: {exc}") from exc
    return {"status": "ok"}
