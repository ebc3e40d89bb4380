"""Which torch device a name means: the one rule for ``auto``, shared by the HF engine, ``layertap audit`` and a
worker's job audit (``LAYERTAP_DEVICE``), so that each computes where the others would. torch is imported when a
name is read, not with this module: the CLI's help text needs none of it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from layertap.errors import SpecError

if TYPE_CHECKING:
    import torch

DEVICE_HELP = "cpu, cuda, cuda:N, or auto (the first GPU, else the CPU)"


def parse_device(requested: str) -> torch.device | None:
    """``requested`` as a torch device (None for ``auto``), without asking the driver (a settings check must not
    initialize CUDA before a worker forks); SpecError for a name torch does not know."""
    import torch

    if requested == "auto":
        return None
    try:
        return torch.device(requested)
    except RuntimeError:
        raise SpecError(f"device {requested!r}: expected {DEVICE_HELP}") from None


def pick_device(requested: str) -> torch.device:
    """``auto``: the first GPU when torch sees one, else the CPU; ``cuda`` means ``cuda:0``; SpecError for a GPU
    that is not there."""
    import torch

    device = parse_device(requested)
    if device is None:
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SpecError(f"device {requested}: no GPU here (torch sees none); use cpu or auto")
        return torch.device("cuda", device.index or 0)
    return device
