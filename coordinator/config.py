"""``CoordinatorSettings``: read once from ``LAYERTAP_*`` variables when the app starts."""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import ByteSize, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class CoordinatorSettings(BaseSettings):
    """The coordinator: where state and messages go, where outputs may be written, who may call it."""

    # hide_input_in_errors: a refusal at start names the setting, not every variable's value (a Redis URL's password).
    model_config = SettingsConfigDict(env_prefix="LAYERTAP_", extra="ignore", hide_input_in_errors=True)

    redis_url: str = Field(description="Redis holding job/shard/sample state.")
    broker_url: str | None = Field(default=None, description="Celery broker; default: redis_url.")
    output_root: Path = Field(description="Every job's output folder must lie under this folder.")
    model_root: Path | None = Field(
        default=None, description="When set, a job's model folder must lie under this folder (403 otherwise)."
    )
    data_root: Path | None = Field(
        default=None, description="When set, a job's dataset must lie under this folder (403 otherwise)."
    )
    api_token: SecretStr | None = Field(
        default=None, description="Bearer token every endpoint but /health, /metrics and the status page needs."
    )
    api_open: bool = Field(
        default=False,
        description="Serve the API without a token: anyone who reaches the port can make the workers read any "
        "path they can read. Without a token the coordinator refuses to start unless this is set.",
    )
    key_prefix: str = "layertap"
    allow_remote_code: bool = Field(
        default=False,
        description="Accept jobs with trust_remote_code (workers then run Python a model folder ships). Off: "
        "a submitter must not be able to run code on the workers by pointing at a folder.",
    )
    reaper_interval_s: float = Field(
        default=5.0, gt=0, description="How often dead leases and lost messages are checked."
    )
    queued_grace_s: float = Field(
        default=120.0,
        gt=0,
        description="A shard queued this long while the broker queue is empty lost its message and is sent again.",
    )
    min_free_bytes: ByteSize = Field(
        default=ByteSize(1 << 30),
        description="Free space workers keep on the output volume (e.g. 50GiB); a job whose expected_tokens "
        "would leave less is refused.",
    )

    @model_validator(mode="after")
    def _defaults(self) -> CoordinatorSettings:
        if self.broker_url is None:
            self.broker_url = self.redis_url
        if self.api_token is not None and not self.api_token.get_secret_value().strip():
            self.api_token = None  # an empty LAYERTAP_API_TOKEN is no token, not "the empty token"
        if self.api_token is None and not self.api_open:
            raise ValueError(
                "LAYERTAP_API_TOKEN is not set: set it (clients send it as a bearer token), or set "
                "LAYERTAP_API_OPEN=true to serve the API to anyone who can reach it"
            )
        if self.api_token is not None and self.api_open:
            raise ValueError("LAYERTAP_API_OPEN=true and LAYERTAP_API_TOKEN are both set: unset one of them")
        return self

    @property
    def queued_grace_ms(self) -> int:
        return int(self.queued_grace_s * 1000)


def require_settings() -> None:
    """Exit with one line naming each setting that is missing or wrong, before the app is built: a refusal to
    start reads better so than as the traceback of a failed lifespan."""
    try:
        CoordinatorSettings()
    except ValidationError as exc:
        problems = [
            f"LAYERTAP_{e['loc'][0]}".upper() + f": {e['msg']}" if e["loc"] else e["msg"].removeprefix("Value error, ")
            for e in exc.errors()
        ]
        sys.exit("layertap coordinator refuses to start: " + "; ".join(problems))
