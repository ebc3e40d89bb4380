"""Checks a captured sample must pass before it may be committed (shapes, dtypes, finiteness)."""

from __future__ import annotations

import torch

from layertap.sample import CapturedSample
from layertap.store.formats.base import Layout
from layertap.store.manifest import Manifest
from sglang_patch.sample_files import FP8


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or +-inf anywhere: the min and max propagate NaN and show an inf. One pass, no
    temporary: on bf16 (CPU, one thread) 9x ``abs().amax()`` and 33x ``isfinite(t).all()``
    (benchmarks/results/writer_commit.md). float8_e4m3fn has no inf and one NaN pattern (all exponent
    and mantissa bits set), which torch's min/max do not take: its bytes are read instead."""
    if t.dtype == FP8:
        return t.numel() == 0 or int((t.view(torch.uint8) & 0x7F).max()) != 0x7F
    return t.numel() == 0 or all(bool(torch.isfinite(x)) for x in torch.aminmax(t))


def state_problems(captured: CapturedSample, layout: Layout, manifest: Manifest) -> list[str]:
    """What is wrong with a capture: aux [T, k, H], finals [T, H] when asked for, all finite."""
    t, h, k = captured.sample.num_tokens, layout.hidden_size, layout.num_aux
    out: list[str] = []
    if captured.sample.loss_mask.shape != (t,):
        out.append(f"loss_mask shape {tuple(captured.sample.loss_mask.shape)} != ({t},)")
    named = [("aux", captured.aux, (t, k, h), True)]
    named.append(("final_post", captured.final_post, (t, h), manifest.final_post_norm))
    named.append(("final_pre", captured.final_pre, (t, h), manifest.final_pre_norm))
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


def _fp8_problems(captured: CapturedSample, layout: Layout) -> list[str]:
    """An FP8 capture (quantized by the server) needs an FP8 store and its scales [T, k+1, 1], finite."""
    if captured.aux.dtype != FP8:
        return []
    if layout.dtype != FP8:
        return [f"the server stored FP8 states (--store-dtype fp8) and this store keeps {layout.dtype}"]
    scales, shape = captured.scales, (captured.sample.num_tokens, layout.num_aux + 1, 1)
    if scales is None or tuple(scales.shape) != shape or scales.dtype != torch.float32:
        return [f"FP8 scales {None if scales is None else (tuple(scales.shape), scales.dtype)} != float32 {shape}"]
    return [] if all_finite(scales) else ["FP8 scales have non-finite values"]
