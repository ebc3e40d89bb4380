"""Pre-commit checks."""

import torch

from layertap.store.validate import all_finite


def test_all_finite_catches_every_nan_and_inf() -> None:
    x = torch.randn(300, 3, 64).to(torch.bfloat16)
    assert all_finite(x) and all_finite(torch.empty(0))
    for pos in (0, 1, 15, 16, 1000, x.numel() - 1):
        for bad in (float("nan"), float("inf"), float("-inf")):
            y = x.clone()
            y.view(-1)[pos] = bad
            assert not all_finite(y), (pos, bad)
