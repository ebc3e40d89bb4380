"""A folder's language-model tensors by name, read from its safetensors shards through the weight index.

Only the tensors asked for are read (a wrapper's vision tower never is; a reader of one decoder layer opens only
the shard that holds it). Names are the language model's own (a wrapper's ``language_model.`` prefix stripped),
and a packed INT4 Linear (``X.weight_packed`` / ``X.weight_scale`` / ``X.weight_shape``) reads as the one tensor
``X.weight``, dequantized exactly (``models/quantization.py``): every consumer sees plain weights.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from layertap.errors import SpecError
from layertap.models.folder import ModelFolder
from layertap.models.quantization import PACKED, SCALE, SHAPE, dequantize

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
             "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}  # fmt: skip


def weight_map(path: Path) -> dict[str, str]:
    """Every tensor name of the folder's checkpoint -> the shard file holding it."""
    if (path / INDEX).is_file():
        return dict(json.loads((path / INDEX).read_text())["weight_map"])
    if (path / SINGLE).is_file():
        with safe_open(str(path / SINGLE), "pt") as f:
            return dict.fromkeys(f.keys(), SINGLE)
    raise SpecError(f"model {path} has neither {INDEX} nor {SINGLE}: no safetensors weights to read")


def layer_of(name: str) -> int | None:
    """The decoder layer a language-model tensor belongs to, or None (embeddings, final norm, LM head)."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True, slots=True)
class Packed:
    """One packed INT4 weight as stored (read, not yet dequantized: a reader can hold a layer at 1/8 of float32)."""

    packed: torch.Tensor
    scale: torch.Tensor
    shape: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.shape))

    def dequantize(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The float32 weight, computed on ``device`` (exact)."""
        return dequantize(self.packed.to(device), self.scale.to(device), self.shape.tolist())


Stored = torch.Tensor | Packed


def nbytes(value: Stored) -> int:
    """Bytes a stored tensor (or packed triple) holds in memory."""
    return value.nbytes if isinstance(value, Packed) else value.numel() * value.element_size()


class FolderWeights:
    """The language model's tensors of ``folder`` under their plain names (packed triples folded into ``.weight``)."""

    def __init__(self, folder: ModelFolder) -> None:
        self.folder = folder
        self._files: dict[str, str] = {}  # stored name -> shard
        self._packed: dict[str, str] = {}  # plain ".weight" name -> its module prefix in the checkpoint
        for stored, shard in weight_map(folder.path).items():
            if not stored.startswith(folder.prefix):
                continue
            self._files[stored] = shard
            name = stored.removeprefix(folder.prefix)
            if name.endswith("." + PACKED):
                self._packed[name.removesuffix(PACKED) + "weight"] = stored.removesuffix(PACKED)
        if self._packed and folder.quantization is None:
            raise SpecError(f"model {folder.path} holds packed INT4 weights but its config states no quantization")
        plain = {s.removeprefix(folder.prefix) for s in self._files}
        plain -= {p.removeprefix(folder.prefix) + k for p in self._packed.values() for k in (PACKED, SCALE, SHAPE)}
        self.names: tuple[str, ...] = tuple(sorted(plain | set(self._packed)))
        self._header: dict[str, tuple[str, list[int]]] | None = None

    def layer(self, index: int) -> list[str]:
        """The plain names of decoder layer ``index``'s tensors."""
        return [n for n in self.names if layer_of(n) == index]

    def numel(self, name: str) -> int:
        """Values of tensor ``name`` once read (a packed weight's dequantized count: 8 per int32 word), from the
        shards' headers: nothing is read."""
        stored = self._packed[name] + PACKED if name in self._packed else self.folder.prefix + name
        return math.prod(self._headers()[stored][1]) * (8 if name in self._packed else 1)

    def stored_bytes(self, name: str) -> int:
        """Bytes tensor ``name`` occupies in the shards (a packed weight's three tensors), from the headers."""
        parts = [self._packed[name] + k for k in (PACKED, SCALE, SHAPE)] if name in self._packed else [
            self.folder.prefix + name]  # fmt: skip
        headers = self._headers()
        return sum(math.prod(headers[p][1]) * _ITEMSIZE[headers[p][0]] for p in parts)

    def _headers(self) -> dict[str, tuple[str, list[int]]]:
        """Stored name -> (safetensors dtype, shape) of every tensor, read once from the shards' headers."""
        if self._header is None:
            self._header = {}
            for shard in sorted(set(self._files.values())):
                with open(self.folder.path / shard, "rb") as f:
                    header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
                self._header.update((k, (v["dtype"], v["shape"])) for k, v in header.items() if k in self._files)
        return self._header

    def read(self, names: Iterable[str], dequantized: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The tensors ``names`` (plain names) in their stored dtypes, a dequantized weight in ``dequantized``
        (float32: exact; a model loaded in bf16 takes them cast one by one, never all in float32 at once); each
        shard is opened once."""
        out = self.read_stored(names)
        for name, value in out.items():
            if isinstance(value, Packed):
                out[name] = value.dequantize().to(dequantized)
        return out  # type: ignore[return-value]

    def read_stored(self, names: Iterable[str]) -> dict[str, Stored]:
        """The tensors ``names`` as stored: plain tensors, and packed weights still packed (`Packed`)."""
        names = list(names)
        wanted: dict[str, list[tuple[str, str]]] = {}  # shard -> (stored name, plain name)
        for name in names:
            stored = (
                [self._packed[name] + k for k in (PACKED, SCALE, SHAPE)]
                if name in self._packed
                else [self.folder.prefix + name]
            )
            for s in stored:
                if s not in self._files:
                    raise SpecError(f"model {self.folder.path}: no tensor {s!r} in its weight index")
                wanted.setdefault(self._files[s], []).append((s, name))
        raw: dict[str, torch.Tensor] = {}
        for shard, entries in wanted.items():
            with safe_open(str(self.folder.path / shard), "pt") as f:
                raw.update((s, f.get_tensor(s)) for s, _ in entries)
        out: dict[str, Stored] = {}
        for name in names:
            if name in self._packed:
                p = self._packed[name]
                out[name] = Packed(raw[p + PACKED], raw[p + SCALE], raw[p + SHAPE])
            else:
                out[name] = raw[self.folder.prefix + name]
        return out
