"""``WorkerSettings``: everything a worker process is told, read once from ``LAYERTAP_*`` variables."""

from __future__ import annotations

import os
import socket

from pydantic import ByteSize, Field, PrivateAttr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from layertap.settings import RunSettings


class WorkerSettings(BaseSettings, RunSettings):
    """One worker process (``celery -A worker worker``): where state lives, how leases work, and how it runs a shard
    (its engine and the engine's settings: the `RunSettings` that ``layertap extract`` takes as flags, with the same
    defaults; ``LAYERTAP_IN_FLIGHT`` is ``--in-flight``). Its stream settings (``LAYERTAP_STREAM``...) are the
    defaults of the jobs that name none (``JobSpec.streaming``); ``LAYERTAP_MOONCAKE_SEGMENT_MIB`` is this host's.

    ``visibility_timeout_s`` must exceed the longest shard: a message not acked by then is delivered
    again (harmless: its token is stale by then, or the shard is done), but it costs a wasted claim.
    """

    model_config = SettingsConfigDict(env_prefix="LAYERTAP_", extra="ignore")

    redis_url: str = Field(description="Redis holding job/shard/sample state.")
    broker_url: str | None = Field(default=None, description="Celery broker; default: redis_url.")
    key_prefix: str = "layertap"
    worker_name: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        description="Name in progress reports; a prefork child adds its own pid to it.",
    )

    allow_remote_code: bool = Field(
        default=False, description="Run jobs with trust_remote_code (the Python a model folder ships)."
    )

    lease_ttl_s: float = Field(
        default=30.0, gt=0, description="A shard is requeued this long after its last heartbeat."
    )
    heartbeat_s: float | None = Field(default=None, gt=0, description="Default: a third of lease_ttl_s.")
    visibility_timeout_s: int = Field(default=6 * 3600, gt=0)
    task_max_retries: int = Field(default=5, ge=0, description="Celery retries of a shard after a server/IO error.")
    retry_backoff_s: float = Field(default=5.0, gt=0, description="First retry delay; doubles each retry.")
    retry_backoff_max_s: float = Field(default=300.0, gt=0)
    max_shard_attempts: int = Field(
        default=10, gt=0, description="Claims of one shard (each a worker that died or gave it back) before it fails."
    )

    metrics_port: int | None = Field(default=None, gt=0, lt=65536, description="Serve Prometheus metrics here.")
    metrics_host: str = Field(default="0.0.0.0", description="Address the metrics server listens on.")
    min_free_bytes: ByteSize = Field(
        default=ByteSize(1 << 30), description="Pause while the output volume has less free (e.g. 50GiB)."
    )
    resume_free_bytes: ByteSize | None = Field(default=None, description="Resume above this; default: floor + 5%.")
    disk_check_s: float = Field(default=2.0, gt=0, description="How often free space is read (working or paused).")

    _read_in_pid: int = PrivateAttr(default_factory=os.getpid)

    @model_validator(mode="after")
    def _consistent(self) -> WorkerSettings:
        if self.broker_url is None:
            self.broker_url = self.redis_url
        if self.heartbeat_s is None:
            self.heartbeat_s = self.lease_ttl_s / 3
        if self.heartbeat_s * 2 > self.lease_ttl_s:
            raise ValueError(
                f"heartbeat_s ({self.heartbeat_s}) must be at most half of lease_ttl_s ({self.lease_ttl_s})"
            )
        if self.resume_free_bytes is None:
            self.resume_free_bytes = ByteSize(self.min_free_bytes * 21 // 20)
        if self.engine == "sglang" and self.dump_root is None:
            raise ValueError("engine 'sglang' needs LAYERTAP_DUMP_ROOT (where the capture plugin writes dumps)")
        return self

    @property
    def lease_ms(self) -> int:
        return int(self.lease_ttl_s * 1000)

    def process_name(self) -> str:
        """This process's worker name: prefork children were forked after the settings were read."""
        pid = os.getpid()
        return self.worker_name if pid == self._read_in_pid else f"{self.worker_name}-{pid}"
