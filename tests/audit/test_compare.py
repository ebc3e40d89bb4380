"""The verdict rules of `layertap.audit.compare.judge` on per-token errors laid out by hand: a state whose
controls pass the bulk test cannot PASS (INCONCLUSIVE), whatever its own error; one far above its floor still FAILs."""

from __future__ import annotations

import torch

from layertap.audit.compare import SampleState, judge


def sample(errors: float, layer: float, tokens: int = 40) -> SampleState:
    """A sample whose floor is 0.1 on every token, its state's error ``errors``, its layer control ``layer``."""
    floor = torch.full((tokens,), 0.1)
    flat = torch.zeros(tokens, dtype=torch.bool)
    cause = None if errors <= 0.2 else "matches no hypothesis"
    return SampleState("s", torch.full((tokens,), errors), floor, flat, flat,
                       {"shift": torch.full((tokens - 1,), 1.4), "layer": torch.full((tokens,), layer)}, cause)  # fmt: skip


def test_a_passing_control_makes_a_state_inconclusive_not_pass_and_far_errors_still_fail() -> None:
    assert judge("final", True, [sample(0.1, layer=5.0)]).verdict == "pass"
    blind = judge("final", True, [sample(0.1, layer=0.15)])
    assert blind.verdict == "inconclusive" and not blind.causes
    assert blind.doubts == [
        "the layer control passed (1.50 x the floor's median): a state one layer off would pass too"
    ]
    far = judge("final", True, [sample(1.0, layer=0.15)])
    assert far.verdict == "fail" and far.failed_samples == {"s": "matches no hypothesis"}
