"""The one place a worker turns its settings and a job into an engine.

``LAYERTAP_ENGINE`` picks the type: ``hf`` (in-process transformers) or ``sglang`` (a patched SGLang server
this process owns or attaches to, `worker.sglang_engine`); both from the worker's `RunSettings` tuned by the
job's engine options.
"""

from __future__ import annotations

import logging

from layertap.engines.base import Engine
from layertap.engines.factory import hf_engine_factory
from layertap.errors import ServerError
from layertap.models.folder import ModelFolder
from layertap.spec import CaptureSpec
from layertap.state.model import JobSpec
from worker.config import WorkerSettings

log = logging.getLogger(__name__)


def build_engine(settings: WorkerSettings, spec: JobSpec, capture: CaptureSpec, folder: ModelFolder) -> Engine:
    """A new engine of ``settings.engine``'s type for ``spec``'s model (``folder``, as read for it), tuned by the
    job's options."""
    if settings.engine == "hf":
        return hf_engine_factory(settings.tuned(spec.engine))(capture, folder)
    from worker import sglang_engine

    return sglang_engine.build_engine(settings, spec, capture, folder)


class EngineCache:
    """One engine per process, kept across shards while jobs need the same model, capture and options."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self._key: tuple | None = None
        self._engine: Engine | None = None

    def get(self, spec: JobSpec, capture: CaptureSpec, folder: ModelFolder) -> Engine:
        key = (str(spec.model), capture, spec.engine)
        if self._engine is None or key != self._key:
            self.close()
            log.info("loading %s engine for %s (capture indices %s)", self.settings.engine, spec.model, capture.layers)
            try:
                self._engine = build_engine(self.settings, spec, capture, folder)
            except ServerError:
                raise
            except Exception as exc:  # a model this worker cannot load: retry, maybe on another worker
                raise ServerError(
                    f"cannot load the {self.settings.engine} engine for {spec.model}: {type(exc).__name__}: {exc}"
                ) from exc
            self._key = key
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
        self._engine, self._key = None, None
