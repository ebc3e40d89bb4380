"""The trainers' per-sample files, built from captured rows.

Shared by the capture plugin, which can write a sample straight in its trainer's format (so the
worker's commit is a rename, no bytes copied), and by the layertap store, which writes it from a
`CapturedSample` otherwise. Imports only torch, safetensors and the standard library.

- ``specforge``: ``torch.save`` of ``input_ids`` long [T], ``loss_mask`` long [T], ``hidden_state``
  [1, T, H] (post-norm final state), ``aux_hidden_state`` [1, T, k*H] (aux layers concatenated in
  capture-index order).
- ``speculators``: safetensors with ``token_ids`` long [T] and ``hidden_states`` [T, k+1, H] (aux
  layers in capture-index order, then the pre-norm final state). Stored as FP8, ``hidden_states`` is
  float8_e4m3fn and ``hidden_states_scales`` float32 [T, k+1, 1] beside it (`quantize_fp8`), which
  speculators 0.9.0 dequantizes with ``--hidden-states-backend fp8`` (hs-connectors' ``FP8Transfer``).
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import IO

import torch

from sglang_patch.contract import FP8_SCALES, PLACED_MASK, SCALES, SPECFORGE, SPECULATORS


def specforge_tensors(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, aux: torch.Tensor, final_post: torch.Tensor
) -> dict[str, torch.Tensor]:
    """SpecForge's dict from ``aux`` [T, k, H] and ``final_post`` [T, H] (dtypes kept as given)."""
    t = int(input_ids.shape[0])
    return {
        "input_ids": _own_storage(input_ids.to(torch.long)),
        "loss_mask": _own_storage(loss_mask.to(torch.long)),
        "hidden_state": _own_storage(final_post.reshape(1, t, -1)),
        "aux_hidden_state": _own_storage(aux.reshape(1, t, -1)),
    }


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t`, copied when it is a view of a larger buffer: torch.save writes a view's whole storage."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def speculators_tensors(
    input_ids: torch.Tensor, states: torch.Tensor, scales: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """speculators' dict from ``states`` [T, k+1, H] (``stack_aux_final``; dtype kept as given) and, for FP8
    states, their ``scales`` (`quantize_fp8`)."""
    tensors = {"token_ids": input_ids.to(torch.long).contiguous(), "hidden_states": states}
    if scales is not None:
        tensors[FP8_SCALES] = scales
    return tensors


FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(FP8).max  # 448
_MIN_SCALE = 1e-12  # hs-connectors' floor: an all-zero row gets a finite scale
_QUANTIZE_ROWS = 1024  # tokens per float32 temporary: ~117 MB at 4 states of width 7168


def quantize_fp8(states: torch.Tensor, *, per_state: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``states`` [T, S, H] (any float dtype, any device) as float8_e4m3fn [T, S, H] and float32 scales, in
    the arithmetic of hs-connectors 0.9.0's ``quantize_tensor_to_fp8`` (scale = amax / 448, at least 1e-12;
    fp8 = x / scale in float32, rounded to nearest), so a file holds what speculators' own writer would.

    ``per_state`` (what stores use): one scale per token and state, [T, S, 1], which speculators' reader
    broadcasts as it does its own [T, 1, 1] (``per_state=False``: one scale per token across the states).
    The float32 quotient is made `_QUANTIZE_ROWS` tokens at a time, so a capture server's device needs
    little memory beside the pass."""
    if per_state:
        low, high = torch.aminmax(states, dim=-1, keepdim=True)
    else:
        low, high = (m.view(-1, *[1] * (states.dim() - 1)) for m in torch.aminmax(states.flatten(1), dim=1))
    scale = (torch.maximum(-low, high).float() / _FP8_MAX).clamp(min=_MIN_SCALE)
    out = torch.empty(states.shape, dtype=FP8, device=states.device)
    for i in range(0, states.shape[0], _QUANTIZE_ROWS):
        rows = slice(i, i + _QUANTIZE_ROWS)
        out[rows] = (states[rows] / scale[rows]).to(FP8)  # bf16 / float32 divides in float32, as x.float() / s
    return out, scale


def dequantize_fp8(states: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """What speculators trains on: ``states.to(dtype) * scales.to(dtype)`` (hs-connectors' dequantization)."""
    return states.to(dtype) * scales.to(dtype)


def stack_aux_final(aux: torch.Tensor, final_pre: torch.Tensor) -> torch.Tensor:
    """speculators' ``hidden_states`` [T, k+1, H]: ``aux`` [T, k, H], then ``final_pre`` [T, H]. Where both are views
    of one such tensor already (a speculators dump as read), that tensor, not a copy."""
    t, k, h = aux.shape
    row = (k + 1) * h
    if (
        aux.dtype == final_pre.dtype
        and aux.untyped_storage().data_ptr() == final_pre.untyped_storage().data_ptr()
        and aux.stride() == (row, h, 1)
        and final_pre.stride() == (row, 1)
        and final_pre.storage_offset() == aux.storage_offset() + k * h
    ):
        return aux.as_strided((t, k + 1, h), (row, h, 1))
    return torch.cat([aux, final_pre.unsqueeze(1)], dim=1)


def ids_sha256(input_ids: torch.Tensor) -> str:
    """sha256 of token ids as int64 little-endian bytes: what a dump's meta.json and the store's index
    record, and what the contract's reader checks against a safetensors file's raw bytes."""
    arr = input_ids.detach().to("cpu", torch.int64).contiguous().numpy().astype("<i8", copy=False)
    return hashlib.sha256(arr.tobytes()).hexdigest()


def mask_runs(mask: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """[start, end) runs of ones in a 0/1 mask [T]; compact for chat masks (a few runs per turn)."""
    m = mask.to(torch.int8).flatten()
    edges = torch.diff(m, prepend=m.new_zeros(1), append=m.new_zeros(1)).nonzero().flatten().tolist()
    return tuple((edges[i], edges[i + 1]) for i in range(0, len(edges), 2))


def mask_from_runs(runs: object, length: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """The 0/1 mask [length] whose ones are the [start, end) `runs`; ValueError if they are not such runs
    (they may come over the wire from a client)."""
    mask = torch.zeros(length, dtype=dtype)
    if not isinstance(runs, list | tuple):
        raise ValueError(f"loss mask runs must be a list of [start, end] pairs, got {type(runs).__name__}")
    previous_end = 0
    for run in runs:
        ok = isinstance(run, list | tuple) and len(run) == 2 and all(isinstance(x, int) for x in run)
        if not ok or not previous_end <= run[0] < run[1] <= length:
            raise ValueError(f"bad loss mask run {run!r}: runs must be sorted [start, end) pairs within [0, {length}]")
        mask[run[0] : run[1]] = 1
        previous_end = run[1]
    return mask


def write_sample(fmt: str, tensors: dict[str, torch.Tensor], f: IO[bytes]) -> None:
    """Serialise a format's tensor dict to ``f`` exactly as its trainer reads it."""
    if fmt == SPECFORGE:
        torch.save(tensors, f)
    elif fmt == SPECULATORS:
        write_safetensors(tensors, f)
    else:
        raise ValueError(f"unknown sample format {fmt!r}")


_SAFETENSORS_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
                      torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8", torch.bool: "BOOL",
                      FP8: "F8_E4M3"}  # fmt: skip


def write_safetensors(tensors: dict[str, torch.Tensor], f: IO[bytes]) -> None:
    """Stream `tensors` (CPU) to ``f`` in the safetensors format, straight from their memory.

    ``safetensors.torch.save`` builds the whole file as one bytes object first: a full extra copy
    of a ~100-200 MB sample per write. The header is what safetensors writes (data in name order,
    8-byte padded JSON); its own reader loads the result.
    """
    names = sorted(tensors)
    header: dict[str, dict] = {}
    offset = 0
    for name in names:
        t = tensors[name]
        header[name] = {"dtype": _SAFETENSORS_CODES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}  # fmt: skip
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(struct.pack("<Q", len(raw)) + raw)
    for name in names:
        t = tensors[name].contiguous()
        if t.nbytes:
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)


def unpack_sample(fmt: str, tensors: dict[str, torch.Tensor], num_aux: int) -> dict[str, torch.Tensor]:
    """Views of a sample file's tensors as ``input_ids``, ``aux`` [T, k, H] and its final state
    (``final_post`` or ``final_pre``), plus a specforge file's (or a placed sample's) ``loss_mask`` [T] and an FP8
    file's ``scales`` [T, k+1, 1]: the inverse of the two builders above, copying nothing."""
    if fmt == SPECFORGE:
        ids, aux = tensors["input_ids"], tensors["aux_hidden_state"][0]
        views = {"input_ids": ids, "aux": aux.view(aux.shape[0], num_aux, -1), "final_post": tensors["hidden_state"][0]}
        return views | {"loss_mask": tensors["loss_mask"]}
    if fmt == SPECULATORS:
        states = tensors["hidden_states"]
        views = {"input_ids": tensors["token_ids"], "aux": states[:, :num_aux], "final_pre": states[:, num_aux]}
        extra = {SCALES: FP8_SCALES, "loss_mask": PLACED_MASK}  # an FP8 file's scales; a placed sample's mask
        return views | {name: tensors[key] for name, key in extra.items() if key in tensors}
    raise ValueError(f"unknown sample format {fmt!r}")
