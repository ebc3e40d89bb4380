"""A real ``mooncake_master`` on loopback for each test of `layertap.stream` (it starts in well under a second)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.mooncake import MooncakeMaster


@pytest.fixture
def mooncake_master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    master = MooncakeMaster.ephemeral(tmp_path)
    yield master
    master.stop()
