"""Checks a captured sample must pass before it may be committed (shapes, dtypes, finiteness)."""

from __future__ import annotations

import torch

from layertap.sample import CapturedSample
from sglang_patch.contract import FP8_DTYPE, SampleLayout
from sglang_patch.sample_files import FP8


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or +-inf anywhere: the min and max propagate NaN and show an inf. One pass, no
    temporary: on bf16 (CPU, one thread) 9x ``abs().amax()`` and 33x ``isfinite(t).all()``
    (benchmarks/results/writer_commit.md). float8_e4m3fn has no inf and one NaN pattern (all exponent
    and mantissa bits set), which torch's min/max do not take: its bytes are read instead."""
    if t.dtype == FP8:
        return t.numel() == 0 or int((t.view(torch.uint8) & 0x7F).max()) != 0x7F
    return t.numel() == 0 or all(bool(torch.isfinite(x)) for x in torch.aminmax(t))


def state_problems(captured: CapturedSample, layout: SampleLayout) -> list[str]:
    """What is wrong with a capture for a store of ``layout``: aux [T, k, H], the layout's finals [T, H], all
    finite; a ready file's loss mask (specforge) the sample's. The one check a capture passes on its way in: a
    dump's file was checked against its meta.json as it was read (`sglang_patch.contract.read_dump`)."""
    t, h, k = captured.sample.num_tokens, layout.hidden_size, len(layout.layers)
    out: list[str] = []
    if captured.sample.loss_mask.shape != (t,):
        out.append(f"loss_mask shape {tuple(captured.sample.loss_mask.shape)} != ({t},)")
    elif (held := captured.source.loss_mask if captured.source else None) is not None and not torch.equal(
        held.to(torch.uint8), captured.sample.loss_mask.to(torch.uint8)
    ):
        out.append(f"its file's loss_mask differs from the sample's ({captured.source.path.name})")
    named = [("aux", captured.aux, (t, k, h), True)]
    named.append(("final_post", captured.final_post, (t, h), "post" in layout.finals))
    named.append(("final_pre", captured.final_pre, (t, h), "pre" in layout.finals))
    for name, tensor, shape, wanted in named:
        if not wanted:
            continue
        if tensor is None:
            out.append(f"{name} missing")
        elif tuple(tensor.shape) != shape:
            out.append(f"{name} shape {tuple(tensor.shape)} != {shape}")
        elif not all_finite(tensor):
            out.append(f"{name} has non-finite values")
    return out + _fp8_problems(captured, layout)


def _fp8_problems(captured: CapturedSample, layout: SampleLayout) -> list[str]:
    """An FP8 capture (quantized by the server) needs an FP8 store and its scales [T, k+1, 1], finite."""
    if captured.aux.dtype != FP8:
        return []
    if layout.dtype != FP8_DTYPE:
        return [f"the server stored FP8 states (--store-dtype fp8) and this store keeps {layout.dtype}"]
    scales, shape = captured.scales, (captured.sample.num_tokens, len(layout.layers) + 1, 1)
    if scales is None or tuple(scales.shape) != shape or scales.dtype != torch.float32:
        return [f"FP8 scales {None if scales is None else (tuple(scales.shape), scales.dtype)} != float32 {shape}"]
    return [] if all_finite(scales) else ["FP8 scales have non-finite values"]
