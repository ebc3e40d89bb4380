"""The trainers' per-sample files, built from captured rows.

Shared by the capture plugin, which can write a sample straight in its trainer's format (so the
worker's commit is a rename, no bytes copied), and by the layertap store, which writes it from a
`CapturedSample` otherwise. Imports only torch, safetensors and the standard library.

- ``specforge``: ``torch.save`` of ``input_ids`` long [T], ``loss_mask`` long [T], ``hidden_state``
  [1, T, H] (post-norm final state), ``aux_hidden_state`` [1, T, k*H] (aux layers concatenated in
  capture-index order).
- ``speculators``: safetensors with ``token_ids`` long [T] and ``hidden_states`` [T, k+1, H] (aux
  layers in capture-index order, then the pre-norm final state).
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import IO

import torch

from sglang_patch.contract import SPECFORGE, SPECULATORS


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


def speculators_tensors(input_ids: torch.Tensor, states: torch.Tensor) -> dict[str, torch.Tensor]:
    """speculators' dict from ``states`` [T, k+1, H] (``stack_aux_final``; dtype kept as given)."""
    return {"token_ids": input_ids.to(torch.long).contiguous(), "hidden_states": states}


def stack_aux_final(aux: torch.Tensor, final_pre: torch.Tensor) -> torch.Tensor:
    """speculators' ``hidden_states`` [T, k+1, H]: ``aux`` [T, k, H], then ``final_pre`` [T, H]."""
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
                      torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8", torch.bool: "BOOL"}  # fmt: skip


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
    (``final_post`` or ``final_pre``): the inverse of the two builders above, copying nothing."""
    if fmt == SPECFORGE:
        ids, aux = tensors["input_ids"], tensors["aux_hidden_state"][0]
        return {"input_ids": ids, "aux": aux.view(aux.shape[0], num_aux, -1), "final_post": tensors["hidden_state"][0]}
    if fmt == SPECULATORS:
        states = tensors["hidden_states"]
        return {"input_ids": tensors["token_ids"], "aux": states[:, :num_aux], "final_pre": states[:, num_aux]}
    raise ValueError(f"unknown sample format {fmt!r}")
