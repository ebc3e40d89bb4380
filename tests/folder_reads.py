"""Who reads a model folder: every `ModelFolder.read` in a block, counted by the module that called it (a run reads
its folder once and passes it down)."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from layertap.models.folder import ModelFolder


@contextmanager
def counting_folder_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Every `ModelFolder.read` inside the block, by the module that called it."""
    reads: Counter[str] = Counter()
    read = ModelFolder.read.__func__  # type: ignore[attr-defined]

    def counted(cls: type[ModelFolder], path: Path) -> ModelFolder:
        reads[sys._getframe(1).f_globals["__name__"]] += 1
        return read(cls, path)

    with monkeypatch.context() as patch:
        patch.setattr(ModelFolder, "read", classmethod(counted))
        yield reads
