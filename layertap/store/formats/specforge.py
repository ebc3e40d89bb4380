"""SpecForge's offline layout: ``rows_<a>-<b>/data_<idx>.ckpt``, a ``torch.save`` of tensors only.

Keys (read with ``torch.load(path, mmap=True, weights_only=False)``): ``input_ids`` long [T],
``loss_mask`` long [T], ``hidden_state`` [1, T, H] post-final-norm, ``aux_hidden_state`` [1, T, k*H]
with the aux layers concatenated in capture-index order.
"""

from __future__ import annotations

from pathlib import Path

import torch

from layertap.sample import CapturedSample
from layertap.store.formats.base import SampleFormat, torch_dtype
from layertap.store.index import SampleRecord
from sglang_patch.contract import SPECFORGE, SampleLayout
from sglang_patch.sample_files import specforge_tensors

ROWS_PER_DIR = 2000


class SpecForgeFormat(SampleFormat):
    name = SPECFORGE
    sample_glob = "rows_*/data_*.ckpt"
    state_keys = ("hidden_state", "aux_hidden_state")

    def relpath(self, index: int) -> str:
        start = index // ROWS_PER_DIR * ROWS_PER_DIR
        return f"rows_{start}-{start + ROWS_PER_DIR}/data_{index}.ckpt"

    def tensors(self, captured: CapturedSample, layout: SampleLayout) -> dict[str, torch.Tensor]:
        if captured.final_post is None:
            raise ValueError("specforge stores the post-norm final state; the capture has none")
        sample = captured.sample
        dtype = torch_dtype(layout)
        return specforge_tensors(
            sample.input_ids, sample.loss_mask, captured.aux.to(dtype), captured.final_post.to(dtype)
        )

    def load(self, path: Path) -> dict[str, torch.Tensor]:
        obj = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        if not isinstance(obj, dict):
            raise ValueError(f"expected a dict of tensors, got {type(obj).__name__}")
        return obj

    def problems(self, tensors: dict[str, torch.Tensor], record: SampleRecord, layout: SampleLayout) -> list[str]:
        out = super().problems(tensors, record, layout)
        mask = tensors.get("loss_mask")
        if not out and not torch.equal(mask.to(torch.uint8), record.loss_mask()):
            out.append("loss_mask differs from the index record")
        return out
