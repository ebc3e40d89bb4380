"""SpecForge's offline layout: ``rows_<a>-<b>/data_<idx>.ckpt``, a ``torch.save`` of tensors only.

Keys (read with ``torch.load(path, mmap=True, weights_only=False)``): ``input_ids`` long [T],
``loss_mask`` long [T], ``hidden_state`` [1, T, H] post-final-norm, ``aux_hidden_state`` [1, T, k*H]
with the aux layers concatenated in capture-index order.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

import torch

from layertap.sample import CapturedSample
from layertap.store.formats.base import Layout, SampleFormat, expect, key_problems
from layertap.store.index import SampleRecord
from sglang_patch.contract import SPECFORGE
from sglang_patch.sample_files import specforge_tensors, write_sample

ROWS_PER_DIR = 2000
KEYS = {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}


class SpecForgeFormat(SampleFormat):
    name = SPECFORGE
    sample_glob = "rows_*/data_*.ckpt"
    ids_key = "input_ids"
    state_keys = ("hidden_state", "aux_hidden_state")

    def relpath(self, index: int) -> str:
        start = index // ROWS_PER_DIR * ROWS_PER_DIR
        return f"rows_{start}-{start + ROWS_PER_DIR}/data_{index}.ckpt"

    def write(self, captured: CapturedSample, layout: Layout, f: IO[bytes]) -> None:
        if captured.final_post is None:
            raise ValueError("specforge stores the post-norm final state; the capture has none")
        sample = captured.sample
        tensors = specforge_tensors(
            sample.input_ids, sample.loss_mask, captured.aux.to(layout.dtype), captured.final_post.to(layout.dtype)
        )
        write_sample(SPECFORGE, tensors, f)

    def load(self, path: Path) -> dict[str, torch.Tensor]:
        obj = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        if not isinstance(obj, dict):
            raise ValueError(f"expected a dict of tensors, got {type(obj).__name__}")
        return obj

    def problems(self, tensors: dict[str, torch.Tensor], record: SampleRecord, layout: Layout) -> list[str]:
        t, h = record.num_tokens, layout.hidden_size
        out = key_problems(tensors, KEYS)
        out += expect("input_ids", tensors.get("input_ids"), (t,), torch.long)
        out += expect("loss_mask", tensors.get("loss_mask"), (t,), torch.long)
        out += expect("hidden_state", tensors.get("hidden_state"), (1, t, h), layout.dtype)
        out += expect("aux_hidden_state", tensors.get("aux_hidden_state"), (1, t, layout.num_aux * h), layout.dtype)
        mask = tensors.get("loss_mask")
        if mask is not None and mask.shape == (t,) and not torch.equal(mask.to(torch.uint8), record.loss_mask()):
            out.append("loss_mask differs from the index record")
        return out
