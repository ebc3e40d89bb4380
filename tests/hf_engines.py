"""The HF engine as tests build it: through `hf_engine_factory` from `RunSettings` (which hold its defaults), on the
CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from layertap.engines.base import Engine
from layertap.engines.factory import EngineFactory, hf_engine_factory
from layertap.models.folder import ModelFolder
from layertap.settings import RunSettings
from layertap.spec import CaptureSpec


def cpu_hf(**settings: Any) -> EngineFactory:
    """The HF engine factory on the CPU with ``settings`` (`RunSettings` fields) for a run to call."""
    return hf_engine_factory(RunSettings(device="cpu", **settings))


def hf_engine(model: Path, capture: CaptureSpec, **settings: Any) -> Engine:
    """An HF engine on the CPU for ``model``'s folder with ``settings``, built outside a run."""
    return cpu_hf(**settings)(capture, ModelFolder.read(model))
