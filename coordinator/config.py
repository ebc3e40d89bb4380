"""``CoordinatorSettings``: read once from ``LAYERTAP_*`` variables when the app starts."""

from __future__ import annotations

from pathlib import Path

from pydantic import ByteSize, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class CoordinatorSettings(BaseSettings):
    """The coordinator: where state and messages go, where outputs may be written, who may call it."""

    model_config = SettingsConfigDict(env_prefix="LAYERTAP_", extra="ignore")

    redis_url: str = Field(description="Redis holding job/shard/sample state.")
    broker_url: str | None = Field(default=None, description="Celery broker; default: redis_url.")
    output_root: Path = Field(description="Every job's output folder must lie under this folder.")
    api_token: SecretStr | None = Field(default=None, description="When set, every endpoint but /health needs it.")
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
            self.api_token = None  # an empty LAYERTAP_API_TOKEN means "no auth", not "the empty token"
        return self

    @property
    def queued_grace_ms(self) -> int:
        return int(self.queued_grace_s * 1000)
