"""`pick_device`: the one rule for a device name, ``auto`` above all, that the HF engine, `layertap audit` and a
worker's job audit share. This machine has no GPU: ``torch.cuda.is_available`` is replaced by a test double
answering "one is here" to see the GPU side of the rule; nothing else is."""

from __future__ import annotations

import pytest
import torch

from layertap.device import pick_device
from layertap.errors import SpecError


def test_auto_is_the_first_gpu_when_torch_sees_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the test double: a GPU is here
    assert pick_device("auto") == torch.device("cuda", 0)
    assert pick_device("cuda") == torch.device("cuda", 0) and pick_device("cuda:1") == torch.device("cuda", 1)
    assert pick_device("cpu") == torch.device("cpu")


def test_auto_is_the_cpu_without_a_gpu_and_a_gpu_asked_for_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the test double: no GPU (as here, but said)
    assert pick_device("auto") == torch.device("cpu")
    with pytest.raises(SpecError, match="device cuda:1: no GPU here"):
        pick_device("cuda:1")


def test_a_name_torch_does_not_know_is_refused() -> None:
    with pytest.raises(SpecError, match="device 'gpu': expected cpu, cuda, cuda:N, or auto"):
        pick_device("gpu")
