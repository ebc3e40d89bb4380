"""The other venvs tests run: the SGLang server's (``LAYERTAP_SGLANG_PYTHON``) and the trainers'
(``LAYERTAP_TRAINERS_PYTHON``). A test that runs one asks for its fixture, which marks it (tests/conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SGLANG_PYTHON = Path(os.environ.get("LAYERTAP_SGLANG_PYTHON", "/opt/sglang-venv/bin/python"))

TRAINERS_PYTHON = Path(os.environ.get("LAYERTAP_TRAINERS_PYTHON", "/opt/trainers-venv/bin/python"))


def _venv_python(python: Path, setup: str) -> Path:
    if not python.exists():
        message = f"no venv at {python.parent.parent}: run {setup}"
        if os.environ.get("CI") or os.environ.get("LAYERTAP_VENVS_REQUIRED"):  # set by scripts/test.sh, which
            pytest.fail(message)  # installed it (CI runs it): a test skipped there would pass for one that never ran
        pytest.skip(message)
    return python


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    """The python of the SGLang server's own venv."""
    return _venv_python(SGLANG_PYTHON, "scripts/setup_sglang_cpu.sh")


@pytest.fixture(scope="session")
def trainers_python() -> Path:
    """The python of the trainers' venv (SpecForge 0.2.0, speculators 0.9.0)."""
    return _venv_python(TRAINERS_PYTHON, "scripts/setup_trainers.sh")
