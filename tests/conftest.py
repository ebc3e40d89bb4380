"""Shared pytest fixtures. Keep each group together under its heading."""

from pathlib import Path

import pytest

from layertap.models import build_tiny_model

# --- Tiny models (layertap.models): built once per session, treat the folders as read-only. ---


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the tiny Llama (6 layers, hidden 64, float32, seed 0)."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_kimi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the tiny Kimi-K2-like DeepseekV3 (MLA + MoE, 5 layers, first dense, hidden 64, float32)."""
    return build_tiny_model("kimi-k2", tmp_path_factory.mktemp("tiny-kimi"))
