"""The worker's SGLang engine: the core's ``SGLangEngine`` on the server the worker's settings name (tuned by
the job's engine options), with its stage latencies going to the worker's metrics."""

from __future__ import annotations

from layertap.engines.base import Engine
from layertap.engines.factory import sglang_engine_factory
from layertap.models.folder import ModelFolder
from layertap.spec import CaptureSpec
from layertap.state.model import JobSpec
from worker.config import WorkerSettings
from worker.metrics import WorkerMetrics


def build_engine(settings: WorkerSettings, spec: JobSpec, capture: CaptureSpec, folder: ModelFolder) -> Engine:
    """The worker's SGLang engine for ``folder`` (``spec.model`` as read), on the server its settings name or launch
    (its log beside the dump root)."""
    assert settings.dump_root is not None  # WorkerSettings requires it for the sglang engine
    metrics = WorkerMetrics(settings.process_name())
    make = sglang_engine_factory(
        spec,
        settings.tuned(spec.engine),
        job=spec.out.name if spec.out else "job",
        dump_root=settings.dump_root,
        log_path=settings.dump_root.parent / f"sglang-{settings.worker_name}.log",
        observe=metrics.observe_stage,
        on_writer=metrics.observe_writer,
    )
    return make(capture, folder)
