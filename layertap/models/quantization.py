"""A folder's weight quantization: the scheme as its config states it, and the exact INT4 packing.

Kimi-K2.5 ships quantization-aware-trained INT4 routed experts in compressed-tensors' ``pack-quantized``
format: symmetric INT4 in groups of 32 along the input dimension, weights only (W4A16). Each quantized Linear
``X`` is three tensors: ``X.weight_packed`` int32 [out, in/8] (each value stored as the nibble q + 8, eight per
word, least significant first along the input dimension), ``X.weight_scale`` [out, in/group] and
``X.weight_shape`` [2]; no zero point. Everything the config's ``ignore`` names stays a plain ``X.weight``.

``Quantization.read`` accepts exactly that scheme and refuses any other in one line naming it, so a folder
layertap cannot dequantize never reaches a loader that would leave its weights at random. ``dequantize`` is
exact in float32 (|q| <= 8 times a bf16 scale needs 12 significant bits); ``quantize`` is the inverse the tiny
builder uses (round to nearest per group).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from layertap.errors import SpecError

METHOD = "compressed-tensors"
FORMAT = "pack-quantized"
PACKED, SCALE, SHAPE = "weight_packed", "weight_scale", "weight_shape"
PACKED_LAYOUT = "int32 words of 8 nibbles q+8, least significant first along the input dimension"
_NIBBLES = 8  # 4-bit values per int32 word
_KNOWN = "compressed-tensors pack-quantized symmetric INT4, group-wise, weights only (Kimi-K2.5's scheme)"


@dataclass(frozen=True, slots=True)
class Quantization:
    """The one scheme layertap reads: compressed-tensors pack-quantized, symmetric INT, group-wise, weights only."""

    bits: int
    group_size: int
    targets: tuple[str, ...]  # module classes the scheme applies to ("Linear")
    ignore: tuple[str, ...]  # module names ("lm_head") or "re:" patterns kept unquantized
    where: str  # "text_config" or "config.json": where the folder states it

    @classmethod
    def read(cls, config: dict[str, Any], *, where: str, model: str) -> Quantization | None:
        """The scheme of ``config["quantization_config"]``; None when there is none; SpecError naming any scheme
        layertap cannot dequantize exactly."""
        qc = config.get("quantization_config")
        if qc is None:
            return None

        def refuse(what: str) -> SpecError:
            return SpecError(f"model {model}: {where} quantization_config is {what}; layertap reads only {_KNOWN}")

        if not isinstance(qc, dict):
            raise refuse(f"{type(qc).__name__}, not a mapping")
        method, fmt = qc.get("quant_method"), qc.get("format")
        if method != METHOD or fmt != FORMAT:
            raise refuse(f"quant_method {method!r}, format {fmt!r}")
        if qc.get("quantization_status", "compressed") != "compressed":
            raise refuse(f"quantization_status {qc.get('quantization_status')!r} (weights not packed)")
        if qc.get("kv_cache_scheme") is not None:
            raise refuse("with a kv_cache_scheme (quantized KV cache)")
        groups = qc.get("config_groups") or {}
        if len(groups) != 1:
            raise refuse(f"{len(groups)} config groups")
        (group,) = groups.values()
        weights = group.get("weights") or {}
        if group.get("input_activations") or group.get("output_activations"):
            raise refuse("quantizing activations (not weights only)")
        scheme = {k: weights.get(k) for k in ("num_bits", "type", "symmetric", "strategy")}
        if scheme != {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"} or weights.get("dynamic"):
            raise refuse(f"weights {scheme}")
        if weights.get("actorder") not in (None, False) or weights.get("block_structure") is not None:
            raise refuse(f"weights with actorder {weights.get('actorder')!r} / block_structure")
        size = weights.get("group_size")
        if not isinstance(size, int) or size <= 0 or size % _NIBBLES:
            raise refuse(f"group_size {size!r}")
        return cls(
            bits=4,
            group_size=size,
            targets=tuple(group.get("targets") or ("Linear",)),
            ignore=tuple(qc.get("ignore") or ()),
            where=where,
        )

    def quantizes(self, module: str) -> bool:
        """Whether Linear ``module`` (its name in the language model) is packed: not matched by ``ignore``."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return False
            elif module == entry or module.endswith("." + entry):
                return False
        return True

    def describe(self) -> dict[str, Any]:
        """What the manifest records next to the compute dtype."""
        return {
            "method": METHOD,
            "format": FORMAT,
            "bits": self.bits,
            "type": "int",
            "symmetric": True,
            "group_size": self.group_size,
            "targets": list(self.targets),
            "ignore": list(self.ignore),
            "packed_layout": PACKED_LAYOUT,
            "stated_in": self.where,
        }


def dequantize(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor | tuple[int, int]) -> torch.Tensor:
    """W = (nibble - 8) x scale as float32 [out, in]: exact, whatever the scale's dtype."""
    out, inp = (int(d) for d in shape)
    if packed.dtype != torch.int32 or packed.shape != (out, inp // _NIBBLES) or inp % _NIBBLES:
        raise ValueError(f"packed {tuple(packed.shape)} {packed.dtype} does not hold an int4 [{out}, {inp}] weight")
    if scale.ndim != 2 or scale.shape[0] != out or inp % scale.shape[1]:
        raise ValueError(f"scale {tuple(scale.shape)} does not group a [{out}, {inp}] weight")
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 4 * _NIBBLES, 4, device=packed.device)
    q = ((words.unsqueeze(-1) >> shifts) & 0xF).reshape(out, inp).to(torch.float32) - 8.0
    group = inp // scale.shape[1]
    return (q.view(out, -1, group) * scale.to(torch.float32).unsqueeze(-1)).view(out, inp)


def quantize(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """``weight`` [out, in] as the three packed tensors (round to nearest per group, symmetric: scale = amax / 7.5
    as compressed-tensors' min-max observer, kept in bf16, q clamped to [-8, 7])."""
    out, inp = weight.shape
    if inp % group_size or group_size % _NIBBLES:
        raise ValueError(f"input dimension {inp} is not a multiple of group size {group_size} (itself of 8)")
    groups = weight.to(torch.float32).view(out, inp // group_size, group_size)
    scale = (groups.abs().amax(dim=-1) / 7.5).clamp_min(1e-8).to(torch.bfloat16)
    q = (groups / scale.to(torch.float32).unsqueeze(-1)).round().clamp(-8, 7).view(out, inp)
    nibbles = (q.to(torch.int64) + 8).view(out, inp // _NIBBLES, _NIBBLES)
    words = (nibbles << torch.arange(0, 4 * _NIBBLES, 4)).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # the same 32 bits as a signed int32
    return {
        PACKED: words.to(torch.int32),
        SCALE: scale,
        SHAPE: torch.tensor([out, inp], dtype=torch.int32),
    }
