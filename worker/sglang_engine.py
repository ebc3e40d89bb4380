"""The worker's SGLang engine: the core's ``SGLangEngine`` on the server the worker's settings name,
with its stage latencies going to the worker's metrics."""

from __future__ import annotations

from pathlib import Path

from layertap.engines.sglang import SGLangEngine, start_server
from layertap.spec import CaptureSpec
from layertap.state.model import JobSpec
from worker.config import WorkerSettings
from worker.metrics import WorkerMetrics


def build_engine(settings: WorkerSettings, spec: JobSpec, capture: CaptureSpec) -> SGLangEngine:
    """The worker's SGLang engine, on the server its settings name or launch."""
    dump_root = Path(settings.dump_root)  # WorkerSettings requires it for the sglang engine
    server = start_server(
        capture,
        spec.model,
        dump_root=dump_root,
        server_url=settings.server_url,
        python=settings.sglang_python,
        sglang_args=settings.sglang_args,
        rid_prefix=settings.rid_prefix,
        log_path=dump_root.parent / f"sglang-{settings.worker_name}.log",
        store_format=spec.format,
        store_dtype=spec.store_dtype,
        trust_remote_code=spec.trust_remote_code,
    )
    job = spec.out.name if spec.out else "job"
    metrics = WorkerMetrics(settings.process_name())
    return SGLangEngine(server, capture, model=spec.model, dump_root=dump_root, job=job, rid_prefix=settings.rid_prefix,
                        allow_dummy_weights=settings.allow_dummy_weights,
                        in_flight=settings.in_flight, observe=metrics.observe_stage,
                        on_writer=metrics.observe_writer)  # fmt: skip
