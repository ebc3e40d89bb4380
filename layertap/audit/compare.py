"""The audit's comparison: per-token errors, the noise floor, routing-explained outliers, controls, a verdict.

Pure functions of tensors, so the CLI audit, the GPU benchmark and the tests judge states the same way.

Per captured state and token t: ``e_t = ||x_t - r_t|| / ||r_t||``, the stored state ``x`` against the reference
``r`` computed in float32. The noise floor ``f_t`` is the same error of the reference run at the store's compute
dtype and rounded to its store dtype (an FP8 store's: quantized and dequantized as its trainer reads it): what an
exact implementation at that precision could store. A state
passes when, for every audited sample, its median error is within ``K_BULK`` x the floor's median (a shifted,
swapped, wrong-layer or wrong-sample state sits at O(1) on every token), and when it has no unexplained outlier
tokens: tokens above ``K_OUTLIER`` x the floor's largest error off routing near-ties. In a MoE model bf16
arithmetic flips an expert choice where the router's k-th and (k+1)-th scores nearly tie; such a token's error
is O(0.1) and is explained when some MoE layer before the state has a margin below ``TIE`` (measured on the
float32 reference). A state after dense layers only has no such excuse: it is held to zero outliers.

The comparison tells a wrong state from noise only where a wrong state sits clearly above the floor. Deep
random-weight bf16 models are chaotic: routing flips and rounding grow until many tokens' bf16 states are as far
from float32's as the next layer's, and a correct store's sample median strays past ``K_BULK`` x its floor's (its
tokens in the flipped tail where the floor's are not). So a state is INCONCLUSIVE, not PASS, when a control passes
the bulk test (at most ``K_BULK`` x the floor's median: a wrong state of that kind would pass), and a sample above
``K_BULK`` x its floor is undecided, not FAILed, when the error and a control of that sample both lie within
``K_BULK`` x its floor's reach (its ``REACH`` quantile): neither the error nor a wrong state is told from the
floor's own spread there. Zeroed rows always fail.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

TIE = 1e-2  # router margin (k-th minus (k+1)-th selection score) below which bf16 arithmetic can flip the choice
K_BULK = 2.0  # a sample's median error may be at most this many times the floor's median
K_OUTLIER = 2.0  # an outlier token is above this many times the floor's largest error off near-ties
MIN_FLOOR = 1e-4  # float32 kernels differ by summation order; a floor below this tells nothing more
UNEXPLAINED_SHARE = 1e-3  # MoE states: outliers off near-ties allowed per token (margins just above TIE)
CONTROLS = ("shift", "layer")  # negative controls: the stored state one token off; against a neighbouring layer
REACH = 0.9  # the floor's quantile taken as how far a correct state's error reaches (above it: routing flips, chaos)
DECIDE = (
    "a float32 store of the same rows is judged against float32's floor, orders of magnitude lower (`layertap "
    "extract --dtype float32`, or a server started with `--dtype float32`); a shallower state is nearer its floor "
    "(`layertap audit --no-final` leaves the final state out)"
)


Verdict = Literal["pass", "fail", "inconclusive"]


def overall(verdicts: list[Verdict]) -> Verdict:
    """The verdict over several: any FAIL fails, else any INCONCLUSIVE is inconclusive (none at all: nothing passed)."""
    if not verdicts or "fail" in verdicts:
        return "fail"
    return "inconclusive" if "inconclusive" in verdicts else "pass"


def token_errors(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[..., T] relative error per token ``||x_t - r_t|| / ||r_t||`` in float32 (a zero reference row counts 1)."""
    got, ref = got.float(), ref.float()
    return (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)


def shifted_errors(got: torch.Tensor, ref: torch.Tensor, shift: int) -> torch.Tensor:
    """Errors if token t's stored row held the reference of token t - shift (empty for one-token samples)."""
    return token_errors(got[shift:], ref[:-shift]) if shift > 0 else token_errors(got[:shift], ref[-shift:])


def zero_rows(got: torch.Tensor) -> torch.Tensor:
    """[T] bool: rows that are exactly zero (a hidden state never is)."""
    return (got != 0).sum(dim=-1) == 0


def floor_median(floor: torch.Tensor) -> float:
    return max(float(floor.median()), MIN_FLOOR) if floor.numel() else MIN_FLOOR


def bulk_ok(errors: torch.Tensor, floor: torch.Tensor) -> bool:
    """Whether ``errors``' median is within ``K_BULK`` x the floor's median: the state IS this reference's."""
    return not errors.numel() or float(errors.median()) <= K_BULK * floor_median(floor)


def diagnose(
    errors: torch.Tensor,
    floor: torch.Tensor,
    zeroed: torch.Tensor,
    shifted: dict[int, torch.Tensor],
    alternatives: dict[str, torch.Tensor],
) -> str:
    """The likeliest cause of a stored state not matching its reference: the first hypothesis under which it
    passes. ``errors`` [T] are the state's against its reference, ``zeroed`` [T] its all-zero rows, ``shifted`` the
    errors if row t held token t-1's state (1) or t+1's (-1), and ``alternatives`` maps a cause (e.g. "layer swapped:
    holds capture index 3") to the state's errors against the reference that cause would have stored. Zeroed rows
    are named before anything else."""
    if n := int(zeroed.sum()):
        return f"{n} token rows zeroed"
    for shift, where in ((1, "later"), (-1, "earlier")):
        if errors.numel() > 1 and bulk_ok(shifted[shift], floor):
            return f"shifted one token ({where}: row t holds token t{'-' if shift > 0 else '+'}1's state)"
    for cause, alt in alternatives.items():
        if bulk_ok(alt, floor):
            return cause
    cut = K_OUTLIER * max(float(floor.max()), MIN_FLOOR) if floor.numel() else MIN_FLOOR
    agree = int(torch.cumprod(errors <= cut, dim=0).sum())
    if 0 < agree < errors.numel():
        return (
            f"another sample's states: equal to this sample's reference for its first {agree} of {errors.numel()} "
            "tokens only, as a request sharing that prefix would be"
        )
    return "another sample's states, or not this model's: matches no shifted, swapped-layer or norm hypothesis"


@dataclass(slots=True)
class SampleState:
    """One audited sample at one captured state: what the verdict needs, kept small (per-token vectors)."""

    sample_id: str
    errors: torch.Tensor  # [T] vs the float32 reference
    floor: torch.Tensor  # [T] the reference at the store's precision vs float32
    near_tie: torch.Tensor  # [T] bool: a router margin below TIE at some MoE layer before the state
    zeroed: torch.Tensor  # [T] bool
    controls: dict[str, torch.Tensor]  # control name -> its errors
    cause: str | None = None  # set when the sample fails (see `diagnose`)

    @property
    def ok(self) -> bool:
        return self.cause is None


@dataclass(slots=True)
class StateVerdict:
    """The verdict on one captured state over every audited sample, with the numbers behind it."""

    state: str
    dense_only: bool
    tokens: int
    median: float
    p99: float
    max: float
    floor_median: float
    floor_p99: float
    floor_max: float
    threshold: float  # tokens above it are outliers
    outliers: int
    routing_explained: int
    unexplained: int
    allowed_unexplained: int
    floor_outliers: int
    controls: dict[str, float]  # control name -> median error over floor median (must be > K_BULK)
    failed_samples: dict[str, str] = field(default_factory=dict)  # sample id -> cause
    undecided_samples: dict[str, float] = field(default_factory=dict)  # sample id -> median over its floor's median
    causes: list[str] = field(default_factory=list)  # why it FAILs
    doubts: list[str] = field(default_factory=list)  # why it cannot be told from noise (INCONCLUSIVE unless FAIL)

    @property
    def verdict(self) -> Verdict:
        return "fail" if self.causes else "inconclusive" if self.doubts else "pass"

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed, "verdict": self.verdict}


def _q(values: torch.Tensor, q: float) -> float:
    return float(values.float().quantile(q)) if values.numel() else 0.0


def judge(state: str, dense_only: bool, samples: list[SampleState]) -> StateVerdict:
    """The verdict on one state from its audited samples (see the module docstring for the rules)."""
    cat = lambda name: torch.cat([getattr(s, name).reshape(-1) for s in samples])  # noqa: E731
    errors, floor, near, zeroed = cat("errors"), cat("floor").float(), cat("near_tie"), cat("zeroed")
    smooth = floor if dense_only else floor[~near]
    threshold = K_OUTLIER * max(_q(smooth, 1.0) if smooth.numel() else 0.0, MIN_FLOOR)
    out = errors > threshold
    explained = out & near & ~zeroed if not dense_only else torch.zeros_like(out)
    unexplained = int((out & ~explained).sum())
    allowed = 0 if dense_only else int(UNEXPLAINED_SHARE * errors.numel())
    floor_out = int((floor > threshold).sum())
    f_med = floor_median(floor)
    controls = {
        name: float(torch.cat([s.controls[name] for s in samples]).median()) / f_med
        for name in CONTROLS
        if any(s.controls[name].numel() for s in samples)
    }
    verdict = StateVerdict(
        state=state, dense_only=dense_only, tokens=errors.numel(), median=_q(errors, 0.5), p99=_q(errors, 0.99),
        max=_q(errors, 1.0), floor_median=_q(floor, 0.5), floor_p99=_q(floor, 0.99), floor_max=_q(floor, 1.0),
        threshold=threshold, outliers=int(out.sum()), routing_explained=int(explained.sum()), unexplained=unexplained,
        allowed_unexplained=allowed, floor_outliers=floor_out, controls=controls,
        failed_samples={s.sample_id: s.cause for s in samples if s.cause and decided(s)},
        undecided_samples={s.sample_id: float(s.errors.median()) / floor_median(s.floor) for s in samples
                           if s.cause and not decided(s)},
    )  # fmt: skip
    if verdict.failed_samples:
        by_cause: dict[str, list[str]] = {}
        for sid, cause in verdict.failed_samples.items():
            by_cause.setdefault(cause, []).append(sid)
        verdict.causes += [f"{cause} (samples {', '.join(_few(sids))})" for cause, sids in by_cause.items()]
    if unexplained > allowed:
        where = "after dense layers only: arithmetic, not routing (e.g. per-rank partial sums)" if dense_only else (
            "not at routing near-ties")  # fmt: skip
        verdict.causes.append(f"{unexplained} tokens above {threshold:.2e} ({allowed} allowed), {where}")
    if not dense_only and verdict.outliers > K_BULK * floor_out + allowed:
        verdict.causes.append(
            f"{verdict.outliers} outlier tokens, more than {K_BULK:g} x the {floor_out} of the reference at the "
            "store's precision: routing flips beyond what that precision explains"
        )
    verdict.doubts += [
        f"the {name} control passed ({ratio:.2f} x the floor's median): a state {_WRONG[name]} would pass too"
        for name, ratio in controls.items()
        if ratio <= K_BULK
    ]
    if verdict.undecided_samples:
        ids = [f"{sid} ({ratio:.2f} x)" for sid, ratio in verdict.undecided_samples.items()]
        verdict.doubts.append(
            f"samples {', '.join(_few(ids))}: median error above {K_BULK:g} x their floor's median, but it and a "
            f"control lie within {K_BULK:g} x their floor's reach (its {REACH:.0%} quantile): noise and a wrong state "
            "look alike there"
        )
    return verdict


def decided(sample: SampleState) -> bool:
    """Whether a sample that failed the bulk test is told from noise: zeroed rows, or its error or every control
    beyond ``K_BULK`` x its floor's reach."""
    if sample.zeroed.any():
        return True
    limit = K_BULK * max(_q(sample.floor.float(), REACH), MIN_FLOOR)
    controls = [c for c in sample.controls.values() if c.numel()]
    return float(sample.errors.median()) > limit or all(float(c.median()) > limit for c in controls)


_WRONG = {"shift": "one token off", "layer": "one layer off"}


def _few(ids: list[str], n: int = 5) -> list[str]:
    return ids[:n] + ([f"... {len(ids) - n} more"] if len(ids) > n else [])
