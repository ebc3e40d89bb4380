"""Engine factories: what a run calls to build its engine once the capture spec is known, from the run's
`RunSettings` (``extract``'s flags, a worker's settings tuned by its job). The engines' own modules are imported
only when a factory is called (they load transformers or httpx)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from layertap.engines.base import Engine
from layertap.models.folder import ModelFolder
from layertap.settings import RunSettings
from layertap.spec import CaptureSpec, ExtractionSpec

# What a run calls with its capture spec and the model folder as it read it (the engine reads no folder again).
EngineFactory = Callable[[CaptureSpec, ModelFolder], Engine]


def hf_engine_factory(settings: RunSettings) -> EngineFactory:
    """An engine factory for the in-process HF engine (it loads transformers when called): ``settings``' device,
    batch limits and compute dtype (None: the folder's own)."""

    def make(capture: CaptureSpec, folder: ModelFolder) -> Engine:
        import torch

        from layertap.engines.hf import HFEngine

        return HFEngine(folder, capture, device=settings.device, max_batch_tokens=settings.batch_tokens,
                        max_batch_size=settings.batch_size,
                        dtype=getattr(torch, settings.dtype) if settings.dtype else None)  # fmt: skip

    return make


def sglang_engine_factory(
    spec: ExtractionSpec,
    settings: RunSettings,
    *,
    job: str,
    dump_root: Path,
    log_path: Path,
    observe: Callable[[str, float], None] | None = None,
    on_writer: Callable[[dict[str, float]], None] | None = None,
) -> EngineFactory:
    """An engine factory for a capture server (imported only when chosen): attached at ``settings.server_url`` or
    launched (its log at ``log_path``), dumping under ``dump_root`` for ``spec``'s store. The server is refused
    unless it serves the model folder it is called with (``spec.model``'s) (with real weights, unless ``settings.allow_dummy_weights``) for this capture.
    ``observe`` and ``on_writer`` receive its stage latencies and writer reports (a worker's metrics)."""

    def make(capture: CaptureSpec, folder: ModelFolder) -> Engine:
        from layertap.engines.sglang import SGLangEngine, start_server

        server = start_server(capture, folder, dump_root=dump_root, server_url=settings.server_url,
                              python=settings.sglang_python, sglang_args=settings.sglang_args,
                              rid_prefix=settings.rid_prefix, log_path=log_path, store_format=spec.format,
                              store_dtype=spec.store_dtype, trust_remote_code=spec.trust_remote_code)  # fmt: skip
        return SGLangEngine(server, capture, folder=folder, dump_root=dump_root, job=job,
                            rid_prefix=settings.rid_prefix, allow_dummy_weights=settings.allow_dummy_weights,
                            in_flight=settings.in_flight, generation_in_flight=settings.generation_in_flight,
                            observe=observe, on_writer=on_writer)  # fmt: skip

    return make
