"""How a process runs an extraction (its engine, the engine's settings, resume checks), defined once.

``layertap extract`` reads these from its flags (`layertap.cli_base.model_options`), a worker from ``LAYERTAP_*``
variables (``worker.config.WorkerSettings`` is a ``RunSettings``), so both have the same settings with the same
defaults; a job may override the engine's tuning (`EngineOptions`, ``submit --in-flight``...).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from layertap.device import DEVICE_HELP, parse_device
from layertap.errors import SpecError
from sglang_patch.contract import DEFAULT_RID_PREFIX

ComputeDtype = Literal["float32", "bfloat16", "float16"]
# Threads checking (sha256, finiteness) and committing samples while the engine runs: 8 validate ~10 GB/s of
# native dumps on an H200 host (sha256 ~1.5 GB/s per thread). `RunSettings.commit_threads`' default, and the
# pipeline's for callers without settings (tests, benchmarks).
COMMIT_THREADS = 8
# Rows regenerating at once on one server (`RunSettings.generation_in_flight`): SGLang decodes every sequence in
# flight in one batch, so this is the decode batch a regenerating run offers its server.
GENERATION_IN_FLIGHT = 64
# While a run captures, how long (ms) a thread waiting for the GIL lets the one holding it run before that one must give
# it up (`sys.setswitchinterval`; CPython's default is 5). `RunSettings.switch_interval_ms`' default.
SWITCH_INTERVAL_MS = 0.5
# What a job may tune per run; the rest of a worker's settings are its host's (paths, server, device).
JOB_TUNABLE = ("batch_tokens", "batch_size", "in_flight", "generation_in_flight")
# Where a job streams its samples (docs/streaming.md); the memory a worker lends Mooncake Store is its host's.
JOB_STREAM = ("stream", "stream_only", "mooncake_master", "stream_redis_url", "stream_name", "stream_unacked")
# Where a run's committed samples go (`layertap.pipeline.targets`): sample files, a stream, or both.
Target = Literal["files", "stream", "both"]


class RunSettings(BaseModel):
    """One process's way of running an extraction: which engine, where it computes, how it re-checks a resume.

    ``in_flight`` is 16 for ``extract`` and the workers alike (it was 16 in the CLI, 8 in a worker): 16 is what the
    H200 capture and end-to-end benchmarks ran at (``benchmarks/results/gpu_capture_h200.md``, ``gpu_e2e_h200.md``,
    ``gpu_int4.md``, ``gpu_fp8.md``; the forward pass never waited on the writers there) and what docker-compose and
    ``.env.example`` already give workers; a worker's window should also stay full across a shard's end, which a
    wider one does better. No run compared 8 with 16 on captures (plain prefill at Kimi-K2 width peaked at 4), so
    the best setting for a deployment is a measured one: set it per worker or per job.
    """

    model_config = ConfigDict(extra="forbid")

    engine: Literal["hf", "sglang"] = Field(
        default="hf", description="hf: transformers in this process; sglang: a capture server."
    )
    device: str = Field(
        default="auto",
        description=f"HF engine (and a worker's job audits): where torch computes: {DEVICE_HELP}.",
    )
    dtype: ComputeDtype | None = Field(
        default=None,
        description="HF engine: the dtype the model computes in (default: the folder's own; a server computes in "
        "what its sglang args' --dtype says).",
    )
    batch_tokens: int = Field(default=8192, gt=0, description="HF engine: padded tokens per forward.")
    batch_size: int = Field(default=16, gt=0, description="HF engine: samples per forward.")
    in_flight: int = Field(default=16, gt=0, description="SGLang engine: requests in flight.")
    generation_in_flight: int = Field(
        default=GENERATION_IN_FLIGHT,
        gt=0,
        description="SGLang engine, with regenerate: rows generating at once (each row's turns in order); decode "
        "batches as many sequences as are in flight, so more keeps the server's decode busier.",
    )
    server_url: str | None = Field(
        default=None, description="SGLang engine: attach to this capture server instead of launching one."
    )
    dump_root: Path | None = Field(
        default=None,
        description="SGLang engine: where the capture plugin writes dumps (the server's view of it). On the "
        "output's filesystem, commits are renames; elsewhere they copy each file once. extract's default: beside "
        "the output; a worker must set it.",
    )
    sglang_python: Path = Field(default=Path("python3"), description="SGLang engine: the server environment's python.")
    sglang_args: str = Field(
        default="", description="SGLang engine: extra server flags, shell-quoted (e.g. '--tp-size 8')."
    )
    rid_prefix: str = Field(default=DEFAULT_RID_PREFIX, description="SGLang engine: request-id prefix it captures.")
    allow_dummy_weights: bool = Field(
        default=False,
        description="SGLang engine: accept a server making random weights (--load-format dummy), for benchmarks; "
        "the manifest says so.",
    )
    commit_threads: int = Field(
        default=COMMIT_THREADS, gt=0, description="Threads checking (sha256, finiteness) and committing samples."
    )
    plan_processes: int = Field(
        default=0,
        ge=0,
        description="Processes planning rows ahead (read, parse, chat template, tokenize: pure Python) off the run's "
        "own process, whose GIL its request and commit threads share; 0: planned in the run's process.",
    )
    switch_interval_ms: float = Field(
        default=SWITCH_INTERVAL_MS,
        gt=0,
        description="While the run captures: how long (ms) a thread waiting for the GIL lets the one holding it run "
        "before it must give it up (CPython's default 5). The run's request, commit and stream threads block and wake "
        "hundreds of times a second, and each wake waits for the GIL behind whichever thread runs Python.",
    )
    stream: Literal["mooncake"] | None = Field(
        default=None,
        description="Also stream each committed sample to trainers: mooncake puts it into Mooncake Store in vLLM "
        "speculators' hs-connectors layout (--format speculators) and its manifest on a Redis stream "
        "(docs/streaming.md); the run ends once every sample is acked.",
    )
    stream_only: bool = Field(
        default=False,
        description="With --stream: write no sample files; each sample goes from the capture straight into the "
        "stream and is done once a consumer acks it (the output folder keeps only the run's record and its acks).",
    )
    mooncake_master: str = Field(
        default="127.0.0.1:50051", description="The Mooncake master (host:port) of the stream (--stream mooncake)."
    )
    mooncake_segment_mib: int = Field(
        default=4096,
        gt=0,
        description="With --stream mooncake: the memory this process lends Mooncake Store for its samples (MiB), "
        "faulted in ahead of the puts; it must hold --stream-unacked of them.",
    )
    stream_redis_url: str = Field(
        default="redis://127.0.0.1:6379/0", description="The Redis holding the stream's manifests (--stream)."
    )
    stream_name: str | None = Field(
        default=None, description="With --stream: the stream's name (default: the output folder's name)."
    )
    stream_unacked: int = Field(
        default=64, gt=0, description="With --stream: the most samples put and not yet acked; then the run waits."
    )
    resume_check: Literal["full", "quick"] = Field(
        default="full",
        description="How committed samples are re-checked before being skipped (full re-hashes every file).",
    )

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        try:
            parse_device(value)
        except SpecError as exc:  # refused before any work (a worker: at start-up, not at its first shard)
            raise ValueError(str(exc)) from None
        return value

    @property
    def target(self) -> Target:
        """Where this run's samples go: files (no stream), stream (--stream-only) or both."""
        return target_of(self.stream, self.stream_only)

    @model_validator(mode="after")
    def _stream_only_streams(self) -> RunSettings:
        target_of(self.stream, self.stream_only)
        return self

    @model_validator(mode="after")
    def _dtype_is_hf(self) -> RunSettings:
        if self.dtype is not None and self.engine != "hf":
            raise ValueError("dtype is the HF engine's; a server computes in what its sglang args' --dtype says")
        return self

    def tuned(self, options: BaseModel) -> RunSettings:
        """These settings with a job's engine options in place of their own where the job set one."""
        return self.model_copy(update=options.model_dump(exclude_none=True))


def target_of(stream: str | None, stream_only: bool | None) -> Target:
    """The target of a run that streams to ``stream`` (None: it does not) with ``stream_only`` set or not; ValueError
    for --stream-only without a stream."""
    if stream is None:
        if stream_only:
            raise ValueError("--stream-only needs a stream to put the samples in: add --stream mooncake")
        return "files"
    return "stream" if stream_only else "both"


def stream_format_problem(stream: str | None, fmt: str) -> str | None:
    """Why a run that streams to ``stream`` cannot store ``fmt`` (None: it can): a stream carries speculators' sample.
    Checked before any work: `extract` before its server starts, a job at submit."""
    if stream is None or fmt == "speculators":
        return None
    return (
        f"--stream {stream} puts hs-connectors' layout, speculators' sample (token_ids, hidden_states [T, k+1, H] with "
        f"the pre-norm final last): run with --format speculators, not {fmt}"
    )


def _job_overrides(model: str, names: tuple[str, ...], doc: str) -> type[BaseModel]:
    """A model ``model`` of the ``names`` fields of `RunSettings`, each optional (None: the worker's own)."""
    fields = {}
    for name in names:
        info = RunSettings.model_fields[name]
        optional = info.annotation | None
        fields[name] = (
            Annotated[optional, *info.metadata] if info.metadata else optional,
            Field(default=None, description=f"{info.description} Default: the worker's own (LAYERTAP_{name.upper()})."),
        )
    return create_model(
        model, __config__=ConfigDict(frozen=True, extra="forbid"), __doc__=doc, __module__=__name__, **fields
    )


EngineOptions = _job_overrides(
    "EngineOptions", JOB_TUNABLE, "A job's engine tuning; None leaves the worker's own setting in force."
)
StreamOptions = _job_overrides(
    "StreamOptions",
    JOB_STREAM,
    "Where a job's samples are streamed (``JobSpec`` has these fields as its own, named as ``extract``'s flags); "
    "None leaves the worker's own setting in force.",
)
