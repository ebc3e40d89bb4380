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


def spread_sample(errors: float, layer: float) -> SampleState:
    """A sample whose floor spreads (median 0.1, its 90% quantile 0.6: deep bf16 chaos), its error ``errors`` on every
    token and its layer control ``layer``; the shift control far away."""
    floor = torch.tensor([0.1] * 30 + [0.6] * 10)
    flat = torch.zeros(40, dtype=torch.bool)
    controls = {"shift": torch.full((39,), 5.0), "layer": torch.full((40,), layer)}
    return SampleState("s", torch.full((40,), errors), floor, flat, flat, controls, "matches no hypothesis")


def test_a_sample_whose_error_and_a_control_lie_within_its_floors_reach_is_undecided_not_failed() -> None:
    undecided = judge("final", True, [spread_sample(0.25, layer=1.0)])
    assert undecided.verdict == "inconclusive" and not undecided.failed_samples and not undecided.causes
    assert list(undecided.undecided_samples) == ["s"] and abs(undecided.undecided_samples["s"] - 2.5) < 1e-6
    assert "noise and a wrong state look alike" in undecided.doubts[-1]
    beyond = judge("final", True, [spread_sample(1.5, layer=1.0)])  # its error beyond 2 x the reach (1.2)
    assert beyond.verdict == "fail" and beyond.failed_samples == {"s": "matches no hypothesis"}
    told = judge("final", True, [spread_sample(0.25, layer=3.0)])  # every control beyond the reach
    assert told.verdict == "fail" and told.failed_samples == {"s": "matches no hypothesis"}
