"""``/streams``: the streams producers put into (`layertap.stream`), CLI runs and jobs alike, read from Redis."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from coordinator.api.deps import KeysDep, RedisDep, require_token
from coordinator.api.errors import responses
from coordinator.schemas import StreamPublic, StreamsPublic
from layertap.state.views import stream_views

router = APIRouter(
    prefix="/streams", tags=["streams"], dependencies=[Depends(require_token)], responses=responses(401, 503)
)


@router.get("")
def list_streams(redis: RedisDep, keys: KeysDep) -> StreamsPublic:
    """The 20 streams opened last, newest first: samples put, acked and in flight, and whether the producer is held."""
    streams = [StreamPublic.of(view) for view in stream_views(redis, keys)]
    return StreamsPublic(count=len(streams), streams=streams)
