"""Free space on the output volume, and what a job will need there.

A 4.6 TB run that fills its disk at 80% wastes the day it took to get there, so a job can be
checked up front (expected tokens x bytes per token must fit above the floor that workers keep)
and workers pause below that floor instead of failing samples (``worker.guard``).
"""

from __future__ import annotations

import os
from pathlib import Path

from layertap.errors import StoreError
from layertap.spec import CaptureSpec
from layertap.store.formats.base import DTYPES

# input_ids and loss_mask are stored as int64 beside the states in every format.
TOKEN_OVERHEAD_BYTES = 16
FP8_SCALE_BYTES = 4  # an FP8 store's float32 scale per token and state


class DiskSpaceError(StoreError):
    """The output volume cannot hold the job: the operator must free space or lower the floor."""


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer can still use on the filesystem holding ``path`` (or its nearest
    existing parent: an output folder may not exist yet)."""
    probe = Path(path).resolve()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize


def bytes_per_token(capture: CaptureSpec, hidden_size: int, store_dtype: str) -> int:
    """Stored bytes per token: each captured state ([T, H] in ``store_dtype``; fp8 adds a float32 scale per
    state) plus ids and mask.

    An upper bound for both formats (a format that keeps only one final state stores less).
    """
    states = len(capture.layers) + int(capture.final_post) + int(capture.final_pre)
    scale = FP8_SCALE_BYTES if store_dtype == "fp8" else 0
    return states * (hidden_size * DTYPES[store_dtype].itemsize + scale) + TOKEN_OVERHEAD_BYTES


def check_budget(estimate_bytes: int, root: Path, *, min_free_bytes: int) -> int:
    """Refuse (DiskSpaceError) a job whose estimated output would leave less than ``min_free_bytes``
    free under ``root``; returns the free bytes seen."""
    free = free_bytes(root)
    if free - estimate_bytes < min_free_bytes:
        raise DiskSpaceError(
            f"the job needs about {human_bytes(estimate_bytes)} but {root} has {human_bytes(free)} free "
            f"and workers keep {human_bytes(min_free_bytes)} free (LAYERTAP_MIN_FREE_BYTES): "
            "free space, use another output volume, or split the dataset"
        )
    return free


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (for messages people read)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
