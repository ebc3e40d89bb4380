"""A folder's language-model tensors by name, read from its safetensors shards through the weight index.

Only the tensors asked for are read (a wrapper's vision tower never is; a reader of one decoder layer opens only
the shard that holds it). Names are the language model's own (a wrapper's ``language_model.`` prefix stripped),
and a packed INT4 Linear (``X.weight_packed`` / ``X.weight_scale`` / ``X.weight_shape``) reads as the one tensor
``X.weight``, dequantized exactly (``models/quantization.py``): every consumer sees plain weights.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from layertap.errors import SpecError
from layertap.models.folder import ModelFolder
from layertap.models.quantization import PACKED, SCALE, SHAPE, dequantize

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


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

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors ``names`` (plain names) in their stored dtypes, a dequantized weight in float32 (exact);
        each shard is opened once."""
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
        out: dict[str, torch.Tensor] = {}
        for name in names:
            if name in self._packed:
                p = self._packed[name]
                tensor = dequantize(raw[p + PACKED], raw[p + SCALE], raw[p + SHAPE].tolist())
            else:
                tensor = raw[self.folder.prefix + name]
            out[name] = tensor
        return out
