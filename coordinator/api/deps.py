"""Dependencies as ``Annotated`` aliases; the app's resources live on ``app.state`` (set in main.lifespan)."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from redis import Redis

from coordinator.config import CoordinatorSettings
from coordinator.dispatch import Dispatcher
from layertap.state.keys import Keys


def get_settings(request: Request) -> CoordinatorSettings:
    return request.app.state.settings


def get_redis(request: Request) -> Redis:
    return request.app.state.redis


def get_keys(request: Request) -> Keys:
    return request.app.state.keys


def get_dispatcher(request: Request) -> Dispatcher:
    return request.app.state.dispatcher


SettingsDep = Annotated[CoordinatorSettings, Depends(get_settings)]
RedisDep = Annotated[Redis, Depends(get_redis)]
KeysDep = Annotated[Keys, Depends(get_keys)]
DispatcherDep = Annotated[Dispatcher, Depends(get_dispatcher)]

_bearer = HTTPBearer(auto_error=False, description="Needed when the coordinator runs with LAYERTAP_API_TOKEN.")


def require_token(
    settings: SettingsDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """Refuse the call unless no token is configured or the bearer token matches it."""
    if settings.api_token is None:
        return
    expected = settings.api_token.get_secret_value()
    if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), expected.encode()):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
        )
