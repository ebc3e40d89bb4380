"""What every output format provides; the store does the atomic write and the index once."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import IO, Literal

import torch

from layertap.sample import CapturedSample
from layertap.store.index import SampleRecord
from layertap.store.validate import all_finite
from sglang_patch.contract import SampleLayout
from sglang_patch.sample_files import FP8, ids_sha256, write_sample

CheckLevel = Literal["quick", "full"]  # full also checks every state is finite (and a file's sha256)

# Store dtype -> the dtype of its stored states; fp8 stores float8_e4m3fn with float32 scales beside it.
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32, "fp8": FP8}


def torch_dtype(layout: SampleLayout) -> torch.dtype:
    """The torch dtype of a layout's states."""
    return getattr(torch, layout.dtype)


class SampleFormat(ABC):
    """A trainer's on-disk layout for one sample, plus anything it needs once the run is complete."""

    name: str
    sample_glob: str  # matches every sample file this format writes, relative to the root
    state_keys: tuple[str, ...]  # the hidden-state tensors (checked for finiteness)

    @abstractmethod
    def relpath(self, index: int) -> str:
        """Where dataset row ``index`` lives, relative to the store root."""

    @abstractmethod
    def tensors(self, captured: CapturedSample, layout: SampleLayout) -> dict[str, torch.Tensor]:
        """One sample's tensors as the trainer reads them (what its file holds, what a stream carries)."""

    def write(self, captured: CapturedSample, layout: SampleLayout, f: IO[bytes]) -> None:
        """Serialise one sample to ``f`` exactly as the trainer reads it."""
        write_sample(self.name, self.tensors(captured, layout), f)

    @abstractmethod
    def load(self, path: Path) -> dict[str, torch.Tensor]:
        """Read a sample file the way the trainer does."""

    def problems(self, tensors: dict[str, torch.Tensor], record: SampleRecord, layout: SampleLayout) -> list[str]:
        """Keys, shapes, dtypes and token facts that disagree with ``record``/``layout`` (empty if fine)."""
        found = {k: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in tensors.items()}
        return layout.problems(found, record.num_tokens)

    def content_problems(
        self, tensors: dict[str, torch.Tensor], record: SampleRecord, layout: SampleLayout, level: CheckLevel
    ) -> list[str]:
        """What a trainer reads (``tensors``) against what its writer recorded: `problems`, the ``input_ids`` hash
        and, ``full``, finiteness. The one check of a sample, read from its file (`OutputStore.check`) or from a
        stream (`layertap.stream.consumer.delivery_problems`)."""
        out = self.problems(tensors, record, layout)
        ids = tensors.get(layout.ids_key)
        if ids is not None and ids_sha256(ids) != record.ids_sha256:
            out.append("input_ids differ from the index record")
        if level == "full":
            out += [f"{k}: non-finite values" for k in self.state_keys if k in tensors and not all_finite(tensors[k])]
        return out

    def finalize(self, root: Path, records: list[SampleRecord]) -> None:  # noqa: B027 - optional step
        """Build whatever the trainer needs beside the sample files (records sorted by index)."""

    def finalized_problems(self, root: Path, records: list[SampleRecord]) -> list[str]:
        """Problems with what ``finalize`` built (empty if it builds nothing)."""
        return []
